"""Adapter for ``ZImagePipeline`` (Z-Image, Z-Image-Turbo)."""

from __future__ import annotations

import math

import torch

from .base import FlowAdapter, PromptEmbeds, Schedule


def _unpad(embeds: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """(B, L, D) hidden states and their (B, L) bool token mask -> the pipeline's list of (L_i, D) embeddings."""
    return [embeds[i][mask[i]] for i in range(len(embeds))]


class ZImageAdapter(FlowAdapter):
    """Z-Image: Qwen3 conditioning (second-to-last hidden states of the chat-templated prompt),
    ZImageTransformer2DModel (single-stream DiT), AutoencoderKL with scaling and shift.

    * Prompt embeddings: the pipeline hands its transformer one (L_i, D) tensor per prompt, the tokens the
      attention mask keeps. They are stored here padded to ``max_sequence_length`` as ``prompt_embeds`` (B, L, D)
      with the tokenizer's mask ``prompt_mask`` (B, L) bool, so they index and concatenate like every other
      family's; every transformer call unpads them with the pipeline's own ``embeds[i][mask[i]]``.
    * Latents are (C, H / s, W / s) with ``s = pipe.vae_scale_factor`` (the transformer cuts 2 x 2 patches); the
      transformer takes a list of (C, 1, h, w) tensors and returns one per sample.
    * Timesteps: the schedule stores the scheduler's timesteps (``sigma * 1000``); the transformer gets them
      inverted, ``(1000 - t) / 1000`` (1 - sigma: 0 at pure noise), and predicts the negated velocity, both as the
      pipeline does it.
    * Guidance is the pipeline's: ``guidance_scale > 0`` (not > 1) turns classifier-free guidance on, and the
      guided prediction is ``cond + guidance_scale * (cond - uncond)`` (so the usual CFG scale is
      ``guidance_scale + 1``); Z-Image-Turbo samples with ``guidance_scale=0`` (one pass per step). The
      unconditional pass uses ``negative_prompt`` (default ``""``, like the pipeline) and runs in the same
      transformer call as the conditional one (cond first). ``cfg_normalization`` (> 0: cap each sample's
      guided norm at that multiple of its conditional norm; ``True`` is 1) and ``cfg_truncation`` (no guidance at
      steps whose ``1 - sigma`` exceeds it; default 1: never) are the pipeline's options of those names.
    * The sigmas are the pipeline's: ``linspace(1, 1 / K, K)`` through the scheduler (Z-Image-Turbo: shift 3, no
      dynamic shifting; with dynamic shifting, ``mu = calculate_shift(image tokens)``).
    * Batch dependence (the pipeline's too): a transformer call pads its samples' sequences (image + caption) to
      the longest and masks the rest, so a sample's velocity can differ in the last bits with the other samples
      of its call (measured on the tiny pipeline, float32: up to 1.8e-6 on values of order 1). The trainers'
      first update pass keeps the rollout's batches, so the first ratio is still exactly 1; ``pipe()`` parity
      holds for the pipeline's own batch.

    Options other than the defaults: ``ZImageAdapter(pipe, negative_prompt="blurry", cfg_normalization=1.0)``,
    given to the trainer in place of the pipeline.
    """

    #: diffusers' Z-Image DreamBooth LoRA script's default targets (examples/dreambooth/
    #: train_dreambooth_lora_z_image.py): the q/k/v/out projections of every attention (noise refiner, context
    #: refiner and main blocks).
    default_lora_target_modules = ("to_k", "to_q", "to_v", "to_out.0")

    def __init__(self, pipe, negative_prompt: str = "", cfg_normalization: float = 0.0,
                 cfg_truncation: float | None = 1.0):
        super().__init__(pipe)
        if not isinstance(negative_prompt, str):
            raise ValueError(f"negative_prompt={negative_prompt!r}: must be a string ('' is the pipeline's default)")
        cfg_normalization = float(cfg_normalization)
        if not math.isfinite(cfg_normalization) or cfg_normalization < 0:
            raise ValueError(f"cfg_normalization={cfg_normalization!r}: must be a number >= 0 (0 disables it)")
        if cfg_truncation is not None and not math.isfinite(float(cfg_truncation)):
            raise ValueError(f"cfg_truncation={cfg_truncation!r}: must be a finite number or None")
        self.negative_prompt = negative_prompt
        self.cfg_normalization = cfg_normalization
        self.cfg_truncation = None if cfg_truncation is None else float(cfg_truncation)
        self.encode_negative = False  # set by configure() when a configured guidance scale is in (0, 1]

    @property
    def pipeline_class(self):
        from diffusers import ZImagePipeline

        return ZImagePipeline

    @property
    def resolution_multiple(self) -> int:
        return self.pipe.vae_scale_factor * 2  # VAE downsampling, then 2 x 2 patches (the pipeline's check)

    def _rope_lens(self) -> list[int]:
        return list(self.transformer.config.axes_lens)

    def configure(self, config) -> None:
        scales = [config.guidance_scale, getattr(config, "eval_guidance_scale", None)]
        self.encode_negative = any(g is not None and g > 0 for g in scales)
        # RoPE positions: the caption takes 1 .. (its length rounded up to 32), the image the next one.
        limit = self._rope_lens()[0]
        padded = -(-config.max_sequence_length // 32) * 32
        if padded + 1 >= limit:
            longest = (limit - 2) // 32 * 32
            raise ValueError(
                f"max_sequence_length={config.max_sequence_length}: this Z-Image transformer's position table "
                f"(axes_lens[0]={limit}) covers captions of at most {longest} tokens (the chat-templated prompt, "
                f"padded to a multiple of 32); pass --max_sequence_length <= {longest} (the pipeline's default: 512)"
            )

    def check_size(self, height, width) -> None:
        _, h, w = self.latent_shape(height, width)
        _, lh, lw = self._rope_lens()
        if h // 2 > lh or w // 2 > lw:  # patch rows / columns take RoPE positions 0 .. n - 1
            s = self.resolution_multiple
            raise ValueError(
                f"height={height}, width={width}: this Z-Image transformer's position table covers at most "
                f"{lh * s} x {lw * s} pixels (axes_lens={self._rope_lens()}, {s} pixels per patch); pass "
                f"--height <= {lh * s} and --width <= {lw * s}"
            )

    def encode_prompts(self, prompts, guidance, max_sequence_length=512) -> PromptEmbeds:
        """``guidance`` (the trainer's ``guidance_scale > 1``) or a configured guidance scale > 0 (Z-Image guides
        for any scale > 0) also encodes the negative prompt."""
        out = self._encode(list(prompts), max_sequence_length)
        if guidance or self.encode_negative:
            neg = self._encode([self.negative_prompt] * len(prompts), max_sequence_length)
            out["negative_prompt_embeds"], out["negative_prompt_mask"] = neg["prompt_embeds"], neg["prompt_mask"]
        return out

    def _texts(self, prompts: list[str]) -> list[str]:
        """The prompts in the pipeline's chat template (thinking enabled), as ``ZImagePipeline`` renders them."""
        return [self.pipe.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                        add_generation_prompt=True, enable_thinking=True)
                for p in prompts]

    def prompt_token_limits(self, max_sequence_length) -> dict[str, int]:
        """The pipeline cuts the chat-formatted prompt at ``max_sequence_length`` Qwen3 tokens."""
        return {"tokenizer": max_sequence_length}

    def prompt_token_counts(self, prompts, name) -> list[int]:
        return [len(ids) for ids in self.pipe.tokenizer(self._texts(prompts)).input_ids]

    def _encode(self, prompts: list[str], max_sequence_length: int) -> PromptEmbeds:
        """``ZImagePipeline._encode_prompt`` without the final unpadding (and without templating the caller's
        list in place)."""
        pipe = self.pipe
        inputs = pipe.tokenizer(self._texts(prompts), padding="max_length", max_length=max_sequence_length,
                                truncation=True, return_tensors="pt")
        ids = inputs.input_ids.to(self.device)
        mask = inputs.attention_mask.to(self.device).bool()
        hidden = pipe.text_encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-2]
        return {"prompt_embeds": hidden, "prompt_mask": mask}

    def latent_shape(self, height, width):
        s = self.pipe.vae_scale_factor
        return (self.transformer.in_channels, 2 * (height // (s * 2)), 2 * (width // (s * 2)))

    def schedule(self, num_inference_steps, height, width) -> Schedule:
        from diffusers.pipelines.z_image.pipeline_z_image import (
            calculate_shift,
            get_default_z_image_sigmas,
            retrieve_timesteps,
        )

        scheduler = self.pipe.scheduler
        _, h, w = self.latent_shape(height, width)
        mu = calculate_shift(
            (h // 2) * (w // 2),
            scheduler.config.get("base_image_seq_len", 256),
            scheduler.config.get("max_image_seq_len", 4096),
            scheduler.config.get("base_shift", 0.5),
            scheduler.config.get("max_shift", 1.15),
        )
        sigmas = get_default_z_image_sigmas(num_inference_steps)
        timesteps, _ = retrieve_timesteps(scheduler, num_inference_steps, self.device, sigmas=sigmas, mu=mu)
        return Schedule(sigmas=scheduler.sigmas.to(self.device, torch.float32).clone(), timesteps=timesteps.clone())

    def _guided_samples(self, t_model: torch.Tensor, guidance_scale: float) -> list[bool]:
        """Which samples get classifier-free guidance at these (B,) model timesteps: all when the scale is > 0,
        except where ``1 - sigma`` exceeds ``cfg_truncation`` (compared as the pipeline does, in Python floats)."""
        if not guidance_scale > 0:
            return [False] * len(t_model)
        trunc = self.cfg_truncation
        if trunc is None or trunc > 1:
            return [True] * len(t_model)
        return [not (t_norm > trunc) for t_norm in t_model.detach().float().tolist()]

    def velocity(self, model, x, timestep, embeds, guidance_scale, detach_uncond=False) -> torch.Tensor:
        b = x.shape[0]
        t = torch.as_tensor(timestep, device=x.device)
        t = t.expand(b) if t.ndim == 0 else t
        t_model = (1000 - t) / 1000
        guided = self._guided_samples(t_model, guidance_scale)
        cond = _unpad(embeds["prompt_embeds"], embeds["prompt_mask"])
        latents = x.to(self.transformer.dtype)
        if any(guided):
            if "negative_prompt_embeds" not in embeds:
                raise ValueError(
                    f"guidance_scale={guidance_scale}: Z-Image guides for any guidance_scale > 0 and needs the "
                    "negative prompt's embeddings; encode the prompts with encode_prompts(..., guidance=True) (the "
                    "trainer does once configure() has seen the guidance scale), or pass guidance_scale=0"
                )
            uncond = _unpad(embeds["negative_prompt_embeds"], embeds["negative_prompt_mask"])
            latents, caps, t_model = latents.repeat(2, 1, 1, 1), cond + uncond, t_model.repeat(2)
        else:
            caps = cond
        out = model(x=list(latents.unsqueeze(2).unbind(dim=0)), t=t_model, cap_feats=caps, return_dict=False)[0]
        if any(guided):
            preds = []
            for j in range(b):
                pos = out[j].float()
                if not guided[j]:
                    preds.append(pos)
                    continue
                neg = out[b + j].float()
                if detach_uncond:
                    neg = neg.detach()
                pred = pos + guidance_scale * (pos - neg)
                if self.cfg_normalization > 0:  # the pipeline's renormalisation
                    ori_pos_norm = torch.linalg.vector_norm(pos)
                    new_pos_norm = torch.linalg.vector_norm(pred)
                    max_new_norm = ori_pos_norm * self.cfg_normalization
                    if new_pos_norm > max_new_norm:
                        pred = pred * (max_new_norm / new_pos_norm)
                preds.append(pred)
            noise_pred = torch.stack(preds, dim=0)
        else:
            noise_pred = torch.stack([o.float() for o in out], dim=0)
        return -noise_pred.squeeze(2)

    def pipeline_embeds(self, embeds: PromptEmbeds) -> dict[str, list[torch.Tensor]]:
        """Stored embeddings as the pipeline's own arguments (per-prompt lists): ``pipe(**adapter.pipeline_embeds(
        embeds), ...)`` samples with them."""
        out = {"prompt_embeds": _unpad(embeds["prompt_embeds"], embeds["prompt_mask"])}
        if "negative_prompt_embeds" in embeds:
            out["negative_prompt_embeds"] = _unpad(embeds["negative_prompt_embeds"], embeds["negative_prompt_mask"])
        return out

    def decode(self, latents) -> torch.Tensor:
        vae = self.pipe.vae
        z = latents.to(vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(z, return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)
