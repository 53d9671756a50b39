"""Adapters for ``Flux2Pipeline`` (FLUX.2-dev) and ``Flux2KleinPipeline`` (FLUX.2 [klein] 4B / 9B, base and
step-distilled)."""

from __future__ import annotations

import inspect
import warnings

import numpy as np
import torch

from .base import FlowAdapter, PromptEmbeds, Schedule


def _lora_targets(num_single_blocks: int) -> tuple[str, ...]:
    """diffusers' FLUX.2 LoRA training scripts' default targets (examples/dreambooth/train_dreambooth_lora_flux2.py
    and ..._flux2_klein.py): the image-stream attention projections of the double-stream blocks, the fused
    QKV + MLP input projection of the single-stream blocks and their output projection, named per block."""
    return ("to_k", "to_q", "to_v", "to_out.0", "to_qkv_mlp_proj",
            *(f"single_transformer_blocks.{i}.attn.to_out" for i in range(num_single_blocks)))


class _Flux2AdapterBase(FlowAdapter):
    """What FLUX.2-dev and Klein share: ``Flux2Transformer2DModel``, ``AutoencoderKLFlux2`` and the latent layout.

    * Latents are stored as the pipeline draws its noise: patchified and batch-normalised, (C, H / 2s, W / 2s) with
      ``C = transformer.config.in_channels`` (4 x the VAE's latent channels; FLUX.2: 128) and ``s`` the VAE factor.
      Every transformer call flattens them into (H / 2s) (W / 2s) tokens (``pipe._pack_latents``, a permutation)
      with the pipeline's position ids (``_prepare_latent_ids``, ``_prepare_text_ids``).
    * The transformer takes ``timestep / 1000``, as the pipeline passes it.
    * The sigmas are the pipeline's: ``linspace(1, 1 / K, K)`` shifted with ``mu = compute_empirical_mu(image
      tokens, K)`` (FLUX.2's empirical shift, which depends on the number of steps too).
    * Decoding: the VAE's batch-norm statistics are undone, the 2 x 2 patches unfolded (``_unpatchify_latents``),
      then ``vae.decode``.
    * Prompts are encoded with ``pipe.encode_prompt`` (the text encoder's hidden states at
      ``text_encoder_out_layers``, stacked); ``text_encoder_out_layers=None`` uses the pipeline's default.
    """

    _pipeline_name = ""

    def __init__(self, pipe, text_encoder_out_layers: tuple[int, ...] | None = None):
        super().__init__(pipe)
        if text_encoder_out_layers is None:
            default = inspect.signature(pipe.encode_prompt).parameters["text_encoder_out_layers"].default
            text_encoder_out_layers = tuple(default)
        n = self._text_layers()
        bad = [i for i in text_encoder_out_layers if not -n - 1 <= int(i) <= n]
        if bad:
            raise ValueError(f"text_encoder_out_layers={tuple(text_encoder_out_layers)}: the text encoder has {n} "
                             f"layers ({n + 1} hidden states); pass indices within it")
        self.text_encoder_out_layers = tuple(int(i) for i in text_encoder_out_layers)
        self._ids_cache = {}

    def _text_layers(self) -> int:
        cfg = self.pipe.text_encoder.config
        cfg = getattr(cfg, "text_config", cfg)
        return cfg.num_hidden_layers

    @property
    def pipeline_class(self):
        import diffusers

        return getattr(diffusers, self._pipeline_name)

    @property
    def _module(self):
        """The pipeline's module (its ``compute_empirical_mu`` and ``retrieve_timesteps``)."""
        import importlib

        return importlib.import_module(self.pipeline_class.__module__)

    @property
    def resolution_multiple(self) -> int:
        return self.pipe.vae_scale_factor * 2  # VAE downsampling, then 2x2 patches

    def latent_shape(self, height, width):
        s2 = self.pipe.vae_scale_factor * 2
        return (self.transformer.config.in_channels, height // s2, width // s2)

    def _encode(self, prompts, max_sequence_length) -> torch.Tensor:
        pe, _ = self.pipe.encode_prompt(prompt=list(prompts), device=self.device,
                                        max_sequence_length=max_sequence_length,
                                        text_encoder_out_layers=self.text_encoder_out_layers)
        return pe

    def schedule(self, num_inference_steps, height, width) -> Schedule:
        scheduler = self.pipe.scheduler
        _, h, w = self.latent_shape(height, width)
        sigmas = None if scheduler.config.get("use_flow_sigmas", False) else (
            np.linspace(1.0, 1 / num_inference_steps, num_inference_steps))
        mu = self._module.compute_empirical_mu(image_seq_len=h * w, num_steps=num_inference_steps)
        timesteps, _ = self._module.retrieve_timesteps(scheduler, num_inference_steps, self.device, sigmas=sigmas,
                                                       mu=mu)
        return Schedule(sigmas=scheduler.sigmas.to(self.device, torch.float32).clone(), timesteps=timesteps.clone())

    def _ids(self, x, text_len):
        """The pipeline's image position ids ((h w, 4): t, row, column, layer) and text ids ((text_len, 4)); the
        transformer uses the first batch row of either, so one row is passed."""
        b, c, h, w = x.shape
        key = (h, w, text_len, x.device)
        if key not in self._ids_cache:
            img_ids = self.pipe._prepare_latent_ids(x[:1])[0].to(x.device)
            txt_ids = self.pipe._prepare_text_ids(torch.empty(1, text_len, 1))[0].to(x.device)
            self._ids_cache[key] = (img_ids, txt_ids)
        return self._ids_cache[key]

    def _forward(self, model, x, timestep, prompt_embeds, guidance):
        """One transformer pass on states ``x`` (B, C, h, w): tokens in, velocity (B, C, h, w) out (model dtype)."""
        dtype = self.transformer.dtype
        b, c, h, w = x.shape
        tokens = self.pipe._pack_latents(x.to(dtype))
        img_ids, txt_ids = self._ids(x, prompt_embeds.shape[1])
        t = torch.as_tensor(timestep, device=x.device)
        t = (t.expand(b) if t.ndim == 0 else t).to(dtype)
        v = model(hidden_states=tokens, timestep=t / 1000, guidance=guidance, encoder_hidden_states=prompt_embeds,
                  txt_ids=txt_ids, img_ids=img_ids, return_dict=False)[0]
        return v[:, : h * w].permute(0, 2, 1).reshape(b, c, h, w)

    def _bn(self, latents):
        vae = self.pipe.vae
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(latents.device,
                                                                                                 latents.dtype)
        return mean, std

    def unpatchify(self, latents: torch.Tensor) -> torch.Tensor:
        """(B, C, h, w) states -> the VAE's latents (B, C / 4, 2h, 2w): batch norm undone, patches unfolded."""
        mean, std = self._bn(latents)
        return self.pipe._unpatchify_latents(latents * std + mean)

    def decode(self, latents) -> torch.Tensor:
        vae = self.pipe.vae
        z = self.unpatchify(latents.float())
        image = vae.decode(z.to(vae.dtype), return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        """(B, C, h, w) states -> the pipeline's token layout (B, h w, C) (``pipe(latents=...)`` takes (B, C, h, w);
        ``Flux2Pipeline(output_type="latent")`` returns this)."""
        return self.pipe._pack_latents(latents)


class Flux2Adapter(_Flux2AdapterBase):
    """FLUX.2-dev: Mistral-Small-3.1 conditioning (its hidden states at layers 10, 20, 30, after the pipeline's
    system message), ``Flux2Transformer2DModel`` with a guidance embedding.

    ``guidance_scale`` (the trainer's config field) is FLUX.2-dev's *distilled* guidance, the value fed to the
    guidance embedding (the pipeline's default 4.0), one transformer pass per step, exactly as ``pipe()`` does it;
    FLUX.2-dev has no true classifier-free guidance. ``pipe(output_type="latent")`` returns :meth:`pack` of the
    final state.
    """

    _pipeline_name = "Flux2Pipeline"

    #: diffusers' FLUX.2-dev LoRA script's defaults (its 48 single-stream blocks named).
    default_lora_target_modules = _lora_targets(48)

    def prompt_token_limits(self, max_sequence_length) -> dict[str, int]:
        """The pipeline cuts the chat-formatted prompt (with its system message) at ``max_sequence_length``
        Mistral tokens."""
        return {"tokenizer": max_sequence_length}

    def prompt_token_counts(self, prompts, name) -> list[int]:
        """Tokens of the chat the pipeline encodes (``format_input`` with ``pipe.system_message``)."""
        pipe = self.pipe
        messages = self._module.format_input(prompts=list(prompts), system_message=pipe.system_message)
        ids = pipe.tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=True,
                                                 return_dict=True)["input_ids"]
        return [len(x) for x in ids]

    def encode_prompts(self, prompts, guidance, max_sequence_length=512) -> PromptEmbeds:
        """``guidance`` is ignored: FLUX.2-dev's guidance is distilled (no negative prompt)."""
        return {"prompt_embeds": self._encode(prompts, max_sequence_length)}

    def velocity(self, model, x, timestep, embeds, guidance_scale, detach_uncond=False) -> torch.Tensor:
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.full([x.shape[0]], guidance_scale, device=x.device, dtype=torch.float32)
        return self._forward(model, x, timestep, embeds["prompt_embeds"], guidance).float()


class Flux2KleinAdapter(_Flux2AdapterBase):
    """FLUX.2 [klein]: Qwen3 conditioning (its hidden states at layers 9, 18, 27 of the chat-formatted prompt),
    ``Flux2Transformer2DModel`` without guidance embedding.

    * Base models (``pipe.config.is_distilled`` False: FLUX.2-klein-base-4B / 9B): ``guidance_scale > 1`` is true
      classifier-free guidance against the empty prompt, as the pipeline does it (two transformer passes per step,
      ``uncond + w (cond - uncond)``).
    * Step-distilled models (FLUX.2-klein-4B / 9B): the pipeline ignores ``guidance_scale``; so does this adapter
      (one pass), with one warning from :meth:`configure` when it is > 1.

    ``Flux2KleinPipeline(output_type="latent")`` returns :meth:`unpatchify` of the final state.
    """

    _pipeline_name = "Flux2KleinPipeline"

    #: diffusers' Klein LoRA script's defaults (24 single-stream blocks named: Klein 9B's; Klein 4B has 20).
    default_lora_target_modules = _lora_targets(24)

    @property
    def is_distilled(self) -> bool:
        return bool(self.pipe.config.get("is_distilled", False))

    def configure(self, config) -> None:
        super().configure(config)
        if self.is_distilled:
            for name in ("guidance_scale", "eval_guidance_scale"):
                value = getattr(config, name, None)
                if value is not None and value > 1:
                    warnings.warn(f"{name}={value}: this Klein pipeline is step-distilled (is_distilled=True), "
                                  "which ignores guidance (one transformer pass, no CFG), as Flux2KleinPipeline "
                                  "does; set it to 1.0 to silence this", UserWarning, stacklevel=3)
                    break

    def _cfg(self, guidance_scale) -> bool:
        return guidance_scale > 1 and not self.is_distilled

    def prompt_token_limits(self, max_sequence_length) -> dict[str, int]:
        """The pipeline cuts the chat-formatted prompt at ``max_sequence_length`` Qwen3 tokens."""
        return {"tokenizer": max_sequence_length}

    def prompt_token_counts(self, prompts, name) -> list[int]:
        """Tokens of the prompt in Qwen3's chat format (thinking disabled), as the pipeline renders it."""
        tok = self.pipe.tokenizer
        texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True,
                                         enable_thinking=False) for p in prompts]
        return [len(ids) for ids in tok(texts).input_ids]

    def encode_prompts(self, prompts, guidance, max_sequence_length=512) -> PromptEmbeds:
        """The negative (empty) prompt is encoded when ``guidance`` and the model is not step-distilled."""
        out = {"prompt_embeds": self._encode(prompts, max_sequence_length)}
        if guidance and not self.is_distilled:
            out["negative_prompt_embeds"] = self._encode([""] * len(prompts), max_sequence_length)
        return out

    def velocity(self, model, x, timestep, embeds, guidance_scale, detach_uncond=False) -> torch.Tensor:
        v = self._forward(model, x, timestep, embeds["prompt_embeds"], None)
        if self._cfg(guidance_scale) and "negative_prompt_embeds" in embeds:
            v_neg = self._forward(model, x, timestep, embeds["negative_prompt_embeds"], None)
            if detach_uncond:
                v_neg = v_neg.detach()
            v = v_neg + guidance_scale * (v - v_neg)
        return v.float()


__all__ = ["Flux2Adapter", "Flux2KleinAdapter"]
