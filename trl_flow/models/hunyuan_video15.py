"""Adapter for ``HunyuanVideo15Pipeline`` (HunyuanVideo-1.5 text-to-video)."""

from __future__ import annotations

import numpy as np
import torch

from .base import FlowAdapter, PromptEmbeds, Schedule
from .wan import _check_num_frames


class HunyuanVideo15Adapter(FlowAdapter):
    """HunyuanVideo-1.5: Qwen2.5-VL + ByT5 conditioning, ``HunyuanVideo15Transformer3DModel``,
    ``AutoencoderKLHunyuanVideo15`` (16x in space, 4x in time, 32 channels).

    * Prompts: ``pipe.encode_prompt`` as it is: the chat template with the pipeline's system message, padded to the
      pipeline's 1000 tokens after its 108-token prefix (``prompt_embeds`` and its mask), and the ByT5 embedding of
      the text in quotes (``prompt_embeds_2``, 256 tokens, zeros without quoted text). Every prompt has these fixed
      lengths, so the trainer's ``max_sequence_length`` does not apply (the pipeline has none); a longer prompt is
      cut by the pipeline's tokenizer, which the trainer's long-prompt warning reports.
    * Guidance is the pipeline's ``guider`` (``ClassifierFreeGuidance``) with the trainer's ``guidance_scale``: above
      1, two passes (conditional, and ``negative_prompt``, default ``""`` as the pipeline's), combined as the guider
      combines them (its ``guidance_rescale`` and ``use_original_formulation`` kept). A guider that guides only part
      of the steps (``start`` / ``stop``), another guider class, or ``guidance_scale < 1`` (which the guider would
      also guide with) are refused.
    * Every call gets ``cat([x, zeros, zero mask])`` (the text-to-video condition the pipeline builds) and 729 zero
      image embeddings; the transformer takes the scheduler's timesteps (0..1000) as they are.
    * Sigmas: ``linspace(1, 0, K + 1)[:-1]`` through the scheduler (its ``shift``), as the pipeline sets them.
    * ``num_frames`` comes from the trainer config (4k + 1); decode divides by the VAE's ``scaling_factor`` and
      decodes one video at a time (diffusers 0.42.1's VAE cannot decode a batch: its mid-block attention mask
      broadcasts wrongly; ``pipe()`` fails on two prompts with ``output_type`` other than ``"latent"``).
    """

    #: The attention projections of every double-stream block, image and text streams (the transformer's
    #: ``attn.to_q/k/v``, ``attn.to_out.0``, ``attn.add_q/k/v_proj``, ``attn.to_add_out``).
    default_lora_target_modules = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj",
                                   "to_add_out")
    pipeline_tag = "text-to-video"

    def __init__(self, pipe, num_frames: int = 33, negative_prompt: str = ""):
        super().__init__(pipe)
        from diffusers import ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler

        if pipe.transformer is None:
            raise ValueError("pipe: the HunyuanVideo15Pipeline has no transformer")
        if not isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler):
            raise ValueError(f"pipe.scheduler: {type(pipe.scheduler).__name__}; the rollout needs the "
                             "FlowMatchEulerDiscreteScheduler HunyuanVideo-1.5 ships with")
        guider = pipe.guider
        if type(guider) is not ClassifierFreeGuidance:
            raise ValueError(f"pipe.guider: {type(guider).__name__}; only ClassifierFreeGuidance (the pipeline's "
                             "default) is supported: pipe.guider = ClassifierFreeGuidance(guidance_scale=...)")
        if (guider.config.start, guider.config.stop) != (0.0, 1.0):
            raise ValueError(f"pipe.guider: guides steps {guider.config.start} to {guider.config.stop} of the "
                             "schedule only; the trainer guides every step: set start=0.0, stop=1.0")
        if pipe.transformer.config.get("use_meanflow", False):
            raise ValueError("pipe: a MeanFlow transformer (use_meanflow=True, the step-distilled checkpoints) is not "
                             "supported: HunyuanVideo15Pipeline samples it as a flow model without its second "
                             "timestep; use a non-distilled checkpoint "
                             "(hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v)")
        if not isinstance(negative_prompt, str):
            raise TypeError(f"negative_prompt: a string (default ''), got {negative_prompt!r}")
        self.num_frames = _check_num_frames(num_frames, pipe.vae_scale_factor_temporal, family="HunyuanVideo-1.5")
        self.negative_prompt = negative_prompt
        self._guiders = {}

    @property
    def pipeline_class(self):
        """The class whose ``save_lora_weights`` writes the LoRA: ``HunyuanVideo15Pipeline`` has no LoRA loader in
        diffusers 0.42.1, so HunyuanVideo's (the same diffusers file format: ``transformer.``-prefixed peft keys),
        which the transformer's own ``load_lora_adapter`` reads (:meth:`lora_load_code`)."""
        from diffusers import HunyuanVideo15Pipeline

        if hasattr(HunyuanVideo15Pipeline, "save_lora_weights"):  # a later diffusers
            return HunyuanVideo15Pipeline
        from diffusers.loaders import HunyuanVideoLoraLoaderMixin

        return HunyuanVideoLoraLoaderMixin

    def lora_load_code(self, source: str) -> str:
        from diffusers import HunyuanVideo15Pipeline

        if hasattr(HunyuanVideo15Pipeline, "load_lora_weights"):
            return super().lora_load_code(source)
        return (f'pipe.transformer.load_lora_adapter("{source}", weight_name="{self.lora_weight_names()[0]}", '
                'prefix="transformer")  # HunyuanVideo15Pipeline has no load_lora_weights (diffusers 0.42)')

    @property
    def resolution_multiple(self) -> int:
        return self.pipe.vae_scale_factor_spatial * self.transformer.config.patch_size

    def configure(self, config) -> None:
        self.num_frames = _check_num_frames(config.num_frames, self.pipe.vae_scale_factor_temporal,
                                            family="HunyuanVideo-1.5")
        for name in ("guidance_scale", "eval_guidance_scale"):
            value = getattr(config, name, None)
            if value is not None and value < 1:
                raise ValueError(f"{name}={value}: HunyuanVideo15Pipeline's guider guides at any scale but 1 (the "
                                 "trainer only above 1); use 1 (no guidance) or a scale > 1")

    def latent_shape(self, height, width):
        s = self.pipe.vae_scale_factor_spatial
        frames = (self.num_frames - 1) // self.pipe.vae_scale_factor_temporal + 1
        return (self.pipe.num_channels_latents, frames, height // s, width // s)

    def output_shape(self, height, width):
        return (self.num_frames, 3, height, width)

    # ------------------------------------------------------------------------------------------- prompts
    def encode_prompts(self, prompts, guidance, max_sequence_length=None) -> PromptEmbeds:
        """``prompt_embeds`` (B, 1000, D) and ``prompt_embeds_mask``, ``prompt_embeds_2`` (B, 256, D2) and
        ``prompt_embeds_mask_2``, in the transformer's dtype as the pipeline makes them; with ``guidance`` the same
        for the negative prompt (``negative_...``)."""
        prompts = list(prompts)
        names = ("prompt_embeds", "prompt_embeds_mask", "prompt_embeds_2", "prompt_embeds_mask_2")
        kw = dict(device=self.device, dtype=self.transformer.dtype, batch_size=len(prompts))
        out = dict(zip(names, self.pipe.encode_prompt(prompt=prompts, **kw)))
        if guidance:
            neg = self.pipe.encode_prompt(prompt=[self.negative_prompt] * len(prompts), **kw)
            out.update(zip((f"negative_{n}" for n in names), neg))
        return out

    def prompt_token_limits(self, max_sequence_length) -> dict[str, int]:
        """The Qwen2.5-VL tokenizer keeps ``tokenizer_max_length`` (1000) tokens after the template's prefix; the
        ByT5 one is given only the quoted text."""
        return {"tokenizer": self.pipe.tokenizer_max_length}

    def prompt_token_counts(self, prompts, name) -> list[int]:
        from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import format_text_input

        pipe = self.pipe
        ids = pipe.tokenizer.apply_chat_template(format_text_input(list(prompts), pipe.system_message),
                                                 add_generation_prompt=True, tokenize=True, return_dict=False)
        return [len(x) - pipe.prompt_template_encode_start_idx for x in ids]

    # ------------------------------------------------------------------------------------------- sampling
    def schedule(self, num_inference_steps, height, width) -> Schedule:
        from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import retrieve_timesteps

        sigmas = np.linspace(1.0, 0.0, num_inference_steps + 1)[:-1]
        timesteps, _ = retrieve_timesteps(self.pipe.scheduler, num_inference_steps, self.device, sigmas=sigmas)
        return Schedule(sigmas=self.pipe.scheduler.sigmas.to(self.device, torch.float32).clone(),
                        timesteps=timesteps.clone())

    def _guider(self, guidance_scale: float):
        """The pipeline's guider with the trainer's scale (cached per scale)."""
        if guidance_scale not in self._guiders:
            self._guiders[guidance_scale] = self.pipe.guider.new(guidance_scale=guidance_scale)
        return self._guiders[guidance_scale]

    def velocity(self, model, x, timestep, embeds, guidance_scale, detach_uncond=False) -> torch.Tensor:
        dtype = self.transformer.dtype
        b = x.shape[0]
        latents = x.to(dtype)
        condition = torch.zeros((b, latents.shape[1] + 1, *latents.shape[2:]), dtype=dtype, device=x.device)
        hidden = torch.cat([latents, condition], dim=1)  # the pipeline's [latents, zero latents, zero mask]
        image_embeds = torch.zeros((b, self.pipe.vision_num_semantic_tokens, self.pipe.vision_states_dim),
                                   dtype=dtype, device=x.device)
        t = torch.as_tensor(timestep, device=x.device)
        t = (t.expand(b) if t.ndim == 0 else t).to(dtype)

        def call(prefix):
            return model(hidden_states=hidden, image_embeds=image_embeds, timestep=t, attention_kwargs=None,
                         return_dict=False, encoder_hidden_states=embeds[f"{prefix}prompt_embeds"],
                         encoder_attention_mask=embeds[f"{prefix}prompt_embeds_mask"],
                         encoder_hidden_states_2=embeds[f"{prefix}prompt_embeds_2"],
                         encoder_attention_mask_2=embeds[f"{prefix}prompt_embeds_mask_2"])[0]

        guider = self._guider(float(guidance_scale))
        cfg = guidance_scale > 1 and "negative_prompt_embeds" in embeds and guider._is_cfg_enabled()
        v = call("")
        if cfg:
            v_uncond = call("negative_")
            if detach_uncond:
                v_uncond = v_uncond.detach()
            v = guider.forward(v, v_uncond)[0]
        return v.float()

    def decode(self, latents) -> torch.Tensor:
        """Videos (B, F, 3, H, W) float32 in [0, 1]: ``latents / scaling_factor`` through the VAE, as the pipeline."""
        vae = self.pipe.vae
        z = latents.to(vae.dtype) / vae.config.scaling_factor
        # one video at a time: the VAE's causal attention mask (diffusers 0.42.1) is (B, L, L) against (B, 1, L, C)
        # queries, which broadcasts wrongly for B > 1 (pipe() fails on a batch of 2 too)
        video = torch.cat([vae.decode(z[i:i + 1], return_dict=False)[0] for i in range(z.shape[0])])
        return (video.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4)

