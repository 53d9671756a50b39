"""Adapter for ``StableDiffusion3Pipeline`` (Stable Diffusion 3 / 3.5)."""

from __future__ import annotations

import torch

from .base import JOINT_ATTENTION_PROJECTIONS, FlowAdapter, PromptEmbeds, Schedule


class SD3Adapter(FlowAdapter):
    """Stable Diffusion 3/3.5: CLIP-L + CLIP-G (+ optional T5) conditioning, SD3Transformer2DModel, AutoencoderKL.

    The transformer takes the timestep on the 0..1000 scale (``sigma * 1000``) exactly as the pipeline passes it.
    """

    default_lora_target_modules = JOINT_ATTENTION_PROJECTIONS

    @property
    def pipeline_class(self):
        from diffusers import StableDiffusion3Pipeline

        return StableDiffusion3Pipeline

    def encode_prompts(self, prompts, guidance, max_sequence_length=256) -> PromptEmbeds:
        pe, npe, pooled, npooled = self.pipe.encode_prompt(
            prompt=list(prompts),
            prompt_2=None,
            prompt_3=None,
            device=self.device,
            do_classifier_free_guidance=guidance,
            max_sequence_length=max_sequence_length,
        )
        out = {"prompt_embeds": pe, "pooled_prompt_embeds": pooled}
        if guidance:
            out["negative_prompt_embeds"] = npe
            out["negative_pooled_prompt_embeds"] = npooled
        return out

    def check_size(self, height, width) -> None:
        cfg, f = self.transformer.config, self.pipe.vae_scale_factor
        max_px = cfg.pos_embed_max_size * cfg.patch_size * f if cfg.get("pos_embed_max_size") else None
        if max_px is not None and max(height, width) > max_px:
            raise ValueError(
                f"height={height}, width={width}: this transformer's position embedding covers at most {max_px} x "
                f"{max_px} pixels (pos_embed_max_size={cfg.pos_embed_max_size} x patch_size={cfg.patch_size} x VAE "
                f"factor {f}); it was trained at {cfg.sample_size * f} x {cfg.sample_size * f} (sample_size x VAE "
                f"factor): pass --height/--width <= {max_px}, e.g. {cfg.sample_size * f}"
            )

    def latent_shape(self, height, width):
        f = self.pipe.vae_scale_factor
        return (self.transformer.config.in_channels, height // f, width // f)

    def schedule(self, num_inference_steps, height, width) -> Schedule:
        from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import (
            calculate_shift,
            retrieve_timesteps,
        )

        scheduler = self.pipe.scheduler
        kwargs = {}
        if scheduler.config.get("use_dynamic_shifting", None):
            _, h, w = self.latent_shape(height, width)
            p = self.transformer.config.patch_size
            kwargs["mu"] = calculate_shift(
                (h // p) * (w // p),
                scheduler.config.get("base_image_seq_len", 256),
                scheduler.config.get("max_image_seq_len", 4096),
                scheduler.config.get("base_shift", 0.5),
                scheduler.config.get("max_shift", 1.16),
            )
        timesteps, _ = retrieve_timesteps(scheduler, num_inference_steps, self.device, **kwargs)
        return Schedule(sigmas=scheduler.sigmas.to(self.device, torch.float32).clone(), timesteps=timesteps.clone())

    def velocity(self, model, x, timestep, embeds, guidance_scale, detach_uncond=False) -> torch.Tensor:
        dtype = self.transformer.dtype
        guided = guidance_scale > 1 and "negative_prompt_embeds" in embeds
        latents = x.to(dtype)
        if guided:
            latents = torch.cat([latents, latents])
            prompt_embeds = torch.cat([embeds["negative_prompt_embeds"], embeds["prompt_embeds"]])
            pooled = torch.cat([embeds["negative_pooled_prompt_embeds"], embeds["pooled_prompt_embeds"]])
        else:
            prompt_embeds, pooled = embeds["prompt_embeds"], embeds["pooled_prompt_embeds"]
        t = torch.as_tensor(timestep, device=latents.device)
        t = t.expand(latents.shape[0]) if t.ndim == 0 else (torch.cat([t, t]) if guided else t)
        v = model(
            hidden_states=latents,
            timestep=t,
            encoder_hidden_states=prompt_embeds,
            pooled_projections=pooled,
            return_dict=False,
        )[0]
        if guided:
            v_uncond, v_cond = v.chunk(2)
            if detach_uncond:
                v_uncond = v_uncond.detach()
            v = v_uncond + guidance_scale * (v_cond - v_uncond)
        return v.float()

    def decode(self, latents) -> torch.Tensor:
        vae = self.pipe.vae
        z = latents.to(vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(z, return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)
