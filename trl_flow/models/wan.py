"""Adapter for ``WanPipeline`` (Wan2.1 text-to-video)."""

from __future__ import annotations

import inspect
import math
import warnings

import torch

from .base import FlowAdapter, PromptEmbeds, Schedule

_SCHEDULER_SWAP_WARNED = False


def _check_num_frames(num_frames, temporal: int, name: str = "num_frames") -> int:
    if not isinstance(num_frames, int) or num_frames < 1 or (num_frames - 1) % temporal:
        raise ValueError(f"{name}={num_frames!r}: Wan needs {temporal}k + 1 frames (the VAE compresses time by "
                         f"{temporal}), e.g. 33 or 81")
    return num_frames


class WanAdapter(FlowAdapter):
    """Wan2.1: UMT5 conditioning, WanTransformer3DModel, AutoencoderKLWan.

    * Latents are 5-D videos (B, C, F', h, w) with ``F' = (F - 1) / 4 + 1`` and ``h, w = H / 8, W / 8``; the
      decoded samples the rewards receive are (B, F, 3, H, W) float32 in [0, 1] (see
      :func:`trl_flow.video.per_frame` to score them with an image reward).
    * The transformer takes the scheduler's timesteps (0..1000) as they are; classifier-free guidance is two passes
      (conditional, then unconditional with ``negative_prompt``, default ``""`` like the pipeline), as the pipeline
      does it.
    * The rollout needs a flow-matching Euler schedule: a pipeline whose scheduler is not a
      ``FlowMatchEulerDiscreteScheduler`` (Wan2.1's default is ``UniPCMultistepScheduler`` with flow sigmas) gets
      ``FlowMatchEulerDiscreteScheduler(shift=flow_shift)`` (other shared config entries kept) instead, with a warning
      (once per process); ``pipe()`` then samples with it too.
    * ``num_frames`` comes from the trainer config (:meth:`configure`); it must be 4k + 1.

    Wan2.2 (two experts with ``boundary_ratio``, or ``expand_timesteps``) is not supported.
    """

    #: Wan's attention projections: ``to_q/k/v/to_out.0`` of both the self-attention (``attn1``) and the text
    #: cross-attention (``attn2``) of every block (Flow-GRPO's Wan targets).
    default_lora_target_modules = ("to_q", "to_k", "to_v", "to_out.0")
    pipeline_tag = "text-to-video"

    def __init__(self, pipe, num_frames: int = 33, negative_prompt: str = ""):
        super().__init__(pipe)
        if pipe.config.get("boundary_ratio") is not None or getattr(pipe, "transformer_2", None) is not None:
            raise ValueError("pipe: Wan2.2 two-expert pipelines (transformer_2 / boundary_ratio) are not supported; "
                             "use a Wan2.1 pipeline")
        if pipe.config.get("expand_timesteps", False):
            raise ValueError("pipe: Wan2.2 pipelines with expand_timesteps=True are not supported")
        if pipe.transformer is None:
            raise ValueError("pipe: the WanPipeline has no transformer")
        self.num_frames = _check_num_frames(num_frames, pipe.vae_scale_factor_temporal)
        self.negative_prompt = negative_prompt
        self._ensure_flow_match_scheduler()

    @property
    def pipeline_class(self):
        from diffusers import WanPipeline

        return WanPipeline

    def _ensure_flow_match_scheduler(self) -> None:
        global _SCHEDULER_SWAP_WARNED
        from diffusers import FlowMatchEulerDiscreteScheduler

        old = self.pipe.scheduler
        if isinstance(old, FlowMatchEulerDiscreteScheduler):
            return
        shift = old.config.get("flow_shift", old.config.get("shift", 1.0))
        accepted = inspect.signature(FlowMatchEulerDiscreteScheduler.__init__).parameters
        shared = {k: v for k, v in old.config.items() if k in accepted and k != "shift"}
        self.pipe.scheduler = FlowMatchEulerDiscreteScheduler(**shared, shift=shift)
        if not _SCHEDULER_SWAP_WARNED:
            _SCHEDULER_SWAP_WARNED = True
            warnings.warn(
                f"WanPipeline: replaced its {type(old).__name__} with FlowMatchEulerDiscreteScheduler(shift={shift}) "
                "(trl_flow's rollout is a flow-matching Euler/SDE sampler); pipe() now samples with it too",
                stacklevel=3,
            )

    def configure(self, config) -> None:
        self.num_frames = _check_num_frames(config.num_frames, self.pipe.vae_scale_factor_temporal)

    @property
    def resolution_multiple(self) -> int:
        p = self.transformer.config.patch_size
        return self.pipe.vae_scale_factor_spatial * math.lcm(p[1], p[2])

    def latent_shape(self, height, width):
        s = self.pipe.vae_scale_factor_spatial
        frames = (self.num_frames - 1) // self.pipe.vae_scale_factor_temporal + 1
        return (self.transformer.config.in_channels, frames, height // s, width // s)

    def output_shape(self, height, width):
        return (self.num_frames, 3, height, width)

    def encode_prompts(self, prompts, guidance, max_sequence_length=512) -> PromptEmbeds:
        prompts = list(prompts)
        pe, npe = self.pipe.encode_prompt(
            prompt=prompts,
            negative_prompt=[self.negative_prompt] * len(prompts),
            do_classifier_free_guidance=guidance,
            max_sequence_length=max_sequence_length,
            device=self.device,
        )
        out = {"prompt_embeds": pe}
        if guidance:
            out["negative_prompt_embeds"] = npe
        return out

    def schedule(self, num_inference_steps, height, width) -> Schedule:
        scheduler = self.pipe.scheduler
        scheduler.set_timesteps(num_inference_steps, device=self.device)  # as WanPipeline.__call__ does
        return Schedule(sigmas=scheduler.sigmas.to(self.device, torch.float32).clone(),
                        timesteps=scheduler.timesteps.clone())

    def velocity(self, model, x, timestep, embeds, guidance_scale, detach_uncond=False) -> torch.Tensor:
        dtype = self.transformer.dtype
        latents = x.to(dtype)
        t = torch.as_tensor(timestep, device=x.device)
        t = t.expand(x.shape[0]) if t.ndim == 0 else t
        v = model(hidden_states=latents, timestep=t, encoder_hidden_states=embeds["prompt_embeds"].to(dtype),
                  return_dict=False)[0]
        if guidance_scale > 1 and "negative_prompt_embeds" in embeds:
            v_uncond = model(hidden_states=latents, timestep=t,
                             encoder_hidden_states=embeds["negative_prompt_embeds"].to(dtype), return_dict=False)[0]
            if detach_uncond:
                v_uncond = v_uncond.detach()
            v = v_uncond + guidance_scale * (v - v_uncond)
        return v.float()

    def decode(self, latents) -> torch.Tensor:
        """Videos (B, F, 3, H, W) float32 in [0, 1] from latents (B, C, F', h, w)."""
        vae = self.pipe.vae
        z = latents.to(vae.dtype)
        mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(z.device, z.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(z.device, z.dtype)
        video = vae.decode(z / inv_std + mean, return_dict=False)[0]  # (B, 3, F, H, W) in [-1, 1]
        return (video.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4)
