"""Adapter for ``FluxPipeline`` (FLUX.1-dev, FLUX.1-schnell)."""

from __future__ import annotations

import math

import numpy as np
import torch

from .base import JOINT_ATTENTION_PROJECTIONS, FlowAdapter, PromptEmbeds, Schedule


def shifted_schedule(scheduler, num_inference_steps: int, image_seq_len: int, device, sigmas) -> Schedule:
    """The schedule FluxPipeline (and QwenImagePipeline, FluxKontextPipeline) computes: ``sigmas`` shifted by
    ``mu = calculate_shift(image_seq_len)`` from the scheduler's config, set on ``scheduler``."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

    mu = calculate_shift(
        image_seq_len,
        scheduler.config.get("base_image_seq_len", 256),
        scheduler.config.get("max_image_seq_len", 4096),
        scheduler.config.get("base_shift", 0.5),
        scheduler.config.get("max_shift", 1.15),
    )
    timesteps, _ = retrieve_timesteps(scheduler, num_inference_steps, device, sigmas=sigmas, mu=mu)
    return Schedule(sigmas=scheduler.sigmas.to(device, torch.float32).clone(), timesteps=timesteps.clone())


class FluxAdapter(FlowAdapter):
    """FLUX.1: CLIP-L (pooled) + T5 conditioning, FluxTransformer2DModel, AutoencoderKL with scaling and shift.

    * Latents are stored unpacked, (C, H / s, W / s) with ``s = pipe.vae_scale_factor``; every transformer call packs
      them into 2x2 patches ((H / 2s) (W / 2s) tokens of 4C channels) with the pipeline's ``_pack_latents`` and
      ``_prepare_latent_image_ids``, and unpacks the velocity. Packing is a permutation, so the kernels, log-probs
      and KL are the same as on packed latents.
    * The transformer takes ``timestep / 1000`` (sigma in [0, 1]), as the pipeline passes it.
    * ``guidance_scale`` (the trainer's config field) is FLUX's *distilled* guidance: the value fed to the guidance
      embedding (FLUX.1-dev: 3.5), one transformer pass per step; ignored when the transformer has no guidance
      embedding (schnell). True classifier-free guidance is the pipeline's ``true_cfg_scale``: pass
      ``true_cfg_scale > 1`` and a ``negative_prompt`` here (a second transformer pass per step).
    * The sigmas are the pipeline's: ``linspace(1, 1 / K, K)`` shifted by ``mu = calculate_shift(image tokens)``.

    To train with true CFG, give the trainer the adapter instead of the pipeline:
    ``FlowGRPOTrainer(config, FluxAdapter(pipe, true_cfg_scale=2.0, negative_prompt="blurry"), rewards, ...)``.
    """

    #: Flow-GRPO's FLUX targets: the attention projections and feed-forward layers of the double-stream blocks
    #: (image and text streams); ``attn.to_q/k/v`` also match the single-stream blocks.
    default_lora_target_modules = JOINT_ATTENTION_PROJECTIONS + (
        "ff.net.0.proj",
        "ff.net.2",
        "ff_context.net.0.proj",
        "ff_context.net.2",
    )

    def __init__(self, pipe, true_cfg_scale: float = 1.0, negative_prompt: str | None = None):
        super().__init__(pipe)
        if not math.isfinite(true_cfg_scale) or true_cfg_scale < 1:
            raise ValueError(f"true_cfg_scale={true_cfg_scale!r}: must be a number >= 1 (1 disables true CFG)")
        if true_cfg_scale > 1 and negative_prompt is None:
            raise ValueError("true_cfg_scale > 1 needs a negative_prompt (FLUX applies true CFG only with one); pass "
                             "negative_prompt='' for an empty one")
        self.true_cfg_scale = float(true_cfg_scale)
        self.negative_prompt = negative_prompt
        self._ids_cache = {}

    @property
    def pipeline_class(self):
        from diffusers import FluxPipeline

        return FluxPipeline

    @property
    def true_cfg(self) -> bool:
        return self.true_cfg_scale > 1

    @property
    def resolution_multiple(self) -> int:
        return self.pipe.vae_scale_factor * 2  # VAE downsampling, then 2x2 packing

    def configure(self, config) -> None:
        if config.max_sequence_length > 512:
            raise ValueError(f"max_sequence_length={config.max_sequence_length}: FLUX's T5 takes at most 512 tokens")

    def encode_prompts(self, prompts, guidance, max_sequence_length=512) -> PromptEmbeds:
        """``guidance`` (the trainer's ``guidance_scale > 1``) is ignored: FLUX's guidance is distilled; the negative
        prompt is encoded when this adapter does true CFG."""
        pe, pooled, _ = self.pipe.encode_prompt(
            prompt=list(prompts), prompt_2=None, device=self.device, max_sequence_length=max_sequence_length
        )
        out = {"prompt_embeds": pe, "pooled_prompt_embeds": pooled}
        if self.true_cfg:
            npe, npooled, _ = self.pipe.encode_prompt(
                prompt=[self.negative_prompt] * len(prompts), prompt_2=None, device=self.device,
                max_sequence_length=max_sequence_length,
            )
            out["negative_prompt_embeds"] = npe
            out["negative_pooled_prompt_embeds"] = npooled
        return out

    def latent_shape(self, height, width):
        s = self.pipe.vae_scale_factor
        return (self.transformer.config.in_channels // 4, 2 * (height // (2 * s)), 2 * (width // (2 * s)))

    def schedule(self, num_inference_steps, height, width) -> Schedule:
        _, h, w = self.latent_shape(height, width)
        sigmas = None if self.pipe.scheduler.config.get("use_flow_sigmas", False) else (
            np.linspace(1.0, 1 / num_inference_steps, num_inference_steps))
        return shifted_schedule(self.pipe.scheduler, num_inference_steps, (h // 2) * (w // 2), self.device, sigmas)

    def velocity(self, model, x, timestep, embeds, guidance_scale, detach_uncond=False) -> torch.Tensor:
        pipe = self.pipe
        dtype = self.transformer.dtype
        b, c, h, w = x.shape
        latents = pipe._pack_latents(x.to(dtype), b, c, h, w)
        img_ids, txt_ids = self._ids(h, w, embeds["prompt_embeds"].shape[1], x.device, dtype)
        t = torch.as_tensor(timestep, device=x.device)
        t = (t.expand(b) if t.ndim == 0 else t).to(dtype)
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.full([b], guidance_scale, device=x.device, dtype=torch.float32)

        def call(prompt_embeds, pooled):
            return model(hidden_states=latents, timestep=t / 1000, guidance=guidance, pooled_projections=pooled,
                         encoder_hidden_states=prompt_embeds, txt_ids=txt_ids, img_ids=img_ids, return_dict=False)[0]

        v = call(embeds["prompt_embeds"], embeds["pooled_prompt_embeds"])
        if self.true_cfg and "negative_prompt_embeds" in embeds:
            v_neg = call(embeds["negative_prompt_embeds"], embeds["negative_pooled_prompt_embeds"])
            if detach_uncond:
                v_neg = v_neg.detach()
            v = v_neg + self.true_cfg_scale * (v - v_neg)
        s = pipe.vae_scale_factor
        return pipe._unpack_latents(v, h * s, w * s, s).float()

    def _ids(self, h, w, text_len, device, dtype):
        """The pipeline's latent image ids ((h / 2)(w / 2), 3) and text ids (text_len, 3), built once per shape."""
        key = (h, w, text_len, device, dtype)
        if key not in self._ids_cache:
            img_ids = self.pipe._prepare_latent_image_ids(1, h // 2, w // 2, device, dtype)
            self._ids_cache[key] = (img_ids, torch.zeros(text_len, 3, device=device, dtype=dtype))
        return self._ids_cache[key]

    def decode(self, latents) -> torch.Tensor:
        vae = self.pipe.vae
        z = latents.to(vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(z, return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        """(B, C, h, w) latents -> the pipeline's packed (B, (h / 2) (w / 2), 4C) (``pipe(latents=...)``, and
        what ``pipe(output_type="latent")`` returns)."""
        b, c, h, w = latents.shape
        return self.pipe._pack_latents(latents, b, c, h, w)
