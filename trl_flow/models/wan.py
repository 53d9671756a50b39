"""Adapter for ``WanPipeline``: Wan2.1 text-to-video, and Wan2.2 (the A14B two-expert form and the TI2V-5B
``expand_timesteps`` form, text-to-video)."""

from __future__ import annotations

import inspect
import math
import warnings

import torch

from . import wan22
from .base import FlowAdapter, PromptEmbeds, Schedule

_SCHEDULER_SWAP_WARNED = False


def _check_guidance_scale_2(value, two_experts: bool):
    if value is None:
        return None
    if not two_experts:
        raise ValueError(f"guidance_scale_2={value!r}: it guides Wan2.2's low-noise expert (transformer_2); this "
                         "pipeline has one transformer: leave guidance_scale_2 unset")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"guidance_scale_2={value!r}: must be a finite number >= 0")
    return float(value)


def _check_num_frames(num_frames, temporal: int, name: str = "num_frames", family: str = "Wan") -> int:
    if not isinstance(num_frames, int) or num_frames < 1 or (num_frames - 1) % temporal:
        raise ValueError(f"{name}={num_frames!r}: {family} needs {temporal}k + 1 frames (the VAE compresses time by "
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

    Wan2.2, as ``WanPipeline.__call__`` does it:

    * two experts (``transformer_2`` and ``boundary_ratio``, A14B): ``transformer`` serves the steps with
      ``t >= boundary_ratio * num_train_timesteps`` with ``guidance_scale``, ``transformer_2`` the others with
      ``guidance_scale_2`` (None: ``guidance_scale``); classifier-free guidance is on for both iff
      ``guidance_scale > 1`` (the pipeline's rule). ``experts`` (``all`` | ``high_noise`` | ``low_noise``) says
      which are trained; the trainer trains :meth:`trainable_module` (a :class:`~trl_flow.models.wan22.WanExperts`),
      an expert left out stays frozen and its steps are sampled with the ODE kernel (:meth:`trainable_steps`). The
      reference policy is each trained expert with its LoRA disabled (or its frozen copy) and the frozen expert
      itself, so the KL is 0 at a frozen expert's steps. Each trained expert's LoRA is its own diffusers file
      (:mod:`~trl_flow.models.wan22`);
    * ``expand_timesteps`` (TI2V-5B): the transformer gets one timestep per latent token, ``(B, F' h w / 4)``, built
      as the pipeline builds it; the Wan2.2 VAE compresses space by 16 (latents (48, F', H / 16, W / 16)).
    """

    reads_config_fields = ("experts", "guidance_scale_2")

    #: Wan's attention projections: ``to_q/k/v/to_out.0`` of both the self-attention (``attn1``) and the text
    #: cross-attention (``attn2``) of every block (Flow-GRPO's Wan targets).
    default_lora_target_modules = ("to_q", "to_k", "to_v", "to_out.0")
    pipeline_tag = "text-to-video"

    def __init__(self, pipe, num_frames: int = 33, negative_prompt: str = "", guidance_scale_2: float | None = None,
                 experts: str | None = None):
        super().__init__(pipe)
        if pipe.transformer is None:
            raise ValueError("pipe: the WanPipeline has no transformer")
        two = pipe.config.get("boundary_ratio") is not None
        if two and getattr(pipe, "transformer_2", None) is None:
            raise ValueError("pipe: boundary_ratio is set but transformer_2 is None; a Wan2.2 two-expert pipeline "
                             "needs both transformers (Wan-AI/Wan2.2-T2V-A14B-Diffusers holds them)")
        self.two_experts = two
        self.num_frames = _check_num_frames(num_frames, pipe.vae_scale_factor_temporal)
        self.negative_prompt = negative_prompt
        self.guidance_scale_2 = _check_guidance_scale_2(guidance_scale_2, two)
        self._experts_option = experts  # None: the trainer config's `experts`
        self.experts = self._check_experts("all" if experts is None else experts)
        self._experts_module = None
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
        gs2 = getattr(config, "guidance_scale_2", None)
        self.guidance_scale_2 = (_check_guidance_scale_2(gs2, self.two_experts) if gs2 is not None
                                 else self.guidance_scale_2)
        experts = getattr(config, "experts", "all")
        if self._experts_option is not None and experts not in ("all", self._experts_option):
            raise ValueError(f"experts={experts!r} in the config, but the WanAdapter was built with "
                             f"experts={self._experts_option!r}; set it in one place")
        self.experts = self._check_experts(self._experts_option if self._experts_option is not None else experts)
        self._experts_module = None
        if self.two_experts and self.experts != "all":  # a stochastic step must be served by a trained expert
            mask = self.trainable_steps(self.schedule(config.num_inference_steps, config.height, config.width))
            if not bool(mask[:-1].any()):
                raise ValueError(
                    f"experts={self.experts!r}: no step but the last (always deterministic) of the "
                    f"num_inference_steps={config.num_inference_steps} schedule is served by the trained expert "
                    f"(boundary_ratio={self.pipe.config.boundary_ratio}); raise num_inference_steps or train "
                    "experts='all'")

    def _check_experts(self, experts) -> str:
        if experts not in wan22.EXPERT_CHOICES:
            raise ValueError(f"experts={experts!r}: must be one of {sorted(wan22.EXPERT_CHOICES)}")
        if experts != "all" and not self.two_experts:
            raise ValueError(f"experts={experts!r}: this WanPipeline has one transformer (no boundary_ratio / "
                             "transformer_2); use experts='all'")
        return experts

    # ------------------------------------------------------------------------------------- what is trained
    def trained_components(self) -> tuple[str, ...]:
        return wan22.EXPERT_CHOICES[self.experts] if self.two_experts else ("transformer",)

    def trainable_module(self) -> torch.nn.Module:
        """``pipe.transformer`` (one transformer), or the :class:`~trl_flow.models.wan22.WanExperts` of the trained
        experts (two experts; the same object on every call)."""
        if not self.two_experts:
            return self.pipe.transformer
        if self._experts_module is None:
            self._experts_module = wan22.WanExperts({n: getattr(self.pipe, n) for n in self.trained_components()})
        return self._experts_module

    @property
    def partial_forward(self) -> bool:
        """Both experts trained: each step's forward pass runs one of them."""
        return self.two_experts and self.experts == "all"

    def trainable_steps(self, schedule: Schedule):
        """(K,) bool: the steps served by a trained expert (None with one transformer, or both experts trained)."""
        if not self.two_experts or self.experts == "all":
            return None
        high = wan22.expert_of(schedule.timesteps, wan22.boundary_timestep(self.pipe)).cpu()
        return high if self.experts == "high_noise" else ~high

    def lora_weight_names(self) -> tuple[str, ...]:
        if not self.two_experts:
            return super().lora_weight_names()
        return tuple(wan22.LORA_FILES[n] for n in self.trained_components())

    def lora_load_code(self, source: str) -> str:
        if not self.two_experts:
            return super().lora_load_code(source)
        lines = []
        for name in self.trained_components():
            extra = ", load_into_transformer_2=True" if name == "transformer_2" else ""
            lines.append(f'pipe.load_lora_weights("{source}", weight_name="{wan22.LORA_FILES[name]}", '
                         f'adapter_name="{name}"{extra})')
        return "\n".join(lines)

    def save_lora_weights(self, save_directory, state_dict, metadata) -> None:
        if not self.two_experts:
            return super().save_lora_weights(save_directory, state_dict, metadata)
        for name, part in wan22.split_lora_state_dict(state_dict, self.trained_components()).items():
            self._write_lora(save_directory, part, metadata, wan22.LORA_FILES[name])

    def read_lora_weights(self, input_dir: str) -> dict:
        if not self.two_experts:
            return super().read_lora_weights(input_dir)
        out = {}
        for name in self.trained_components():
            part = self._read_lora(input_dir, wan22.LORA_FILES[name])
            out.update({f"{name}.{k}": v for k, v in part.items()})
        return out

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
        """As ``WanPipeline.__call__``: with two experts each sample's timestep picks the expert and its guidance
        scale (``model``: the trainer's :class:`~trl_flow.models.wan22.WanExperts`, whose experts serve their steps,
        the pipeline's frozen expert the others; a plain transformer serves the high-noise steps)."""
        t = torch.as_tensor(timestep, device=x.device)
        t = t.expand(x.shape[0]) if t.ndim == 0 else t
        cfg = guidance_scale > 1 and "negative_prompt_embeds" in embeds  # the pipeline: CFG iff guidance_scale > 1
        if not self.two_experts:
            return self._expert_velocity(model, x, t, embeds, guidance_scale, cfg, detach_uncond)
        high = wan22.expert_of(t, wan22.boundary_timestep(self.pipe))
        gs2 = guidance_scale if self.guidance_scale_2 is None else self.guidance_scale_2
        parts = [(high, self._expert(model, "transformer"), guidance_scale),
                 (~high, self._expert(model, "transformer_2"), gs2)]
        parts = [p for p in parts if bool(p[0].any())]
        if len(parts) == 1:  # the whole batch on one expert: exactly the pipeline's call
            _, m, g = parts[0]
            return self._expert_velocity(m, x, t, embeds, g, cfg, detach_uncond)
        v = None
        for sel, m, g in parts:
            idx = sel.nonzero().squeeze(1)
            part = self._expert_velocity(m, x[idx], t[idx], {k: e[idx] for k, e in embeds.items()}, g, cfg,
                                         detach_uncond)
            v = torch.zeros((x.shape[0], *part.shape[1:]), dtype=part.dtype, device=part.device) if v is None else v
            v = v.index_put((idx,), part)
        return v

    def _expert(self, model, name: str):
        """A callable ``f(**transformer_kwargs)`` for expert ``name``."""
        inner = getattr(model, "module", model)  # a DDP wrapper calls through to the module
        if isinstance(inner, wan22.WanExperts):
            if name in inner.names:
                return lambda **kw: model(expert=name, **kw)
            return getattr(self.pipe, name)
        return model if name == "transformer" else getattr(self.pipe, name)

    def _expert_velocity(self, model, x, t, embeds, guidance_scale, cfg, detach_uncond) -> torch.Tensor:
        dtype = self.transformer.dtype
        latents = self._model_input(x, embeds).to(dtype)
        t = self._model_timestep(t, x)
        extra = self._model_kwargs(embeds, dtype)
        v = model(hidden_states=latents, timestep=t, encoder_hidden_states=embeds["prompt_embeds"].to(dtype),
                  return_dict=False, **extra)[0]
        if cfg:
            v_uncond = model(hidden_states=latents, timestep=t,
                             encoder_hidden_states=embeds["negative_prompt_embeds"].to(dtype), return_dict=False,
                             **extra)[0]
            if detach_uncond:
                v_uncond = v_uncond.detach()
            v = v_uncond + guidance_scale * (v - v_uncond)
        return v.float()

    def _model_input(self, x: torch.Tensor, embeds: PromptEmbeds) -> torch.Tensor:
        """The transformer's ``hidden_states`` for states ``x`` (float32; image-to-video appends its condition)."""
        return x

    def _model_kwargs(self, embeds: PromptEmbeds, dtype: torch.dtype) -> dict:
        """Further transformer keyword arguments from ``embeds`` (image-to-video: the CLIP image embedding)."""
        return {}

    def _model_timestep(self, t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """(B,) timesteps, or with ``expand_timesteps`` (B, F' * ceil(h / 2) * ceil(w / 2)): one per latent token,
        ``ones * t`` as the pipeline builds it."""
        if not self.pipe.config.get("expand_timesteps", False):
            return t
        mask = torch.ones(x.shape[2:], dtype=torch.float32, device=x.device)[:, ::2, ::2].flatten()
        if bool((t == t[0]).all()):  # one timestep for the batch: the pipeline's own expression
            return (mask * t[0]).unsqueeze(0).expand(x.shape[0], -1)
        return mask[None, :] * t[:, None].float()

    def decode(self, latents) -> torch.Tensor:
        """Videos (B, F, 3, H, W) float32 in [0, 1] from latents (B, C, F', h, w)."""
        vae = self.pipe.vae
        z = latents.to(vae.dtype)
        mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(z.device, z.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(z.device, z.dtype)
        video = vae.decode(z / inv_std + mean, return_dict=False)[0]  # (B, 3, F, H, W) in [-1, 1]
        return (video.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4)
