"""Adapter for ``QwenImagePipeline`` (Qwen-Image text-to-image)."""

from __future__ import annotations


import numpy as np
import torch

from .base import FlowAdapter, PromptEmbeds, Schedule
from .flux import shifted_schedule

#: ``QwenImagePipeline`` refuses longer prompts (``max_sequence_length`` cannot be greater than 1024).
MAX_SEQUENCE_LENGTH = 1024
#: ``QwenEmbedRope`` has 4096 positions, shared by the image rows / columns and the text tokens after them.
ROPE_POSITIONS = 4096


class QwenImageAdapter(FlowAdapter):
    """Qwen-Image: Qwen2.5-VL conditioning (the last hidden state of the chat template, its 34-token system prefix
    dropped), QwenImageTransformer2DModel (MM-DiT), AutoencoderKLQwenImage (a one-frame video VAE).

    * Guidance is the pipeline's *true* CFG: the trainer's ``guidance_scale`` is ``pipe(true_cfg_scale=...)``. Above
      1 each velocity is two transformer passes, conditional and with ``negative_prompt`` (default ``" "``, the
      Qwen-Image model card's), combined as ``v_neg + s (v - v_neg)`` and then rescaled per token to the norm of the
      conditional prediction, as the pipeline does. Qwen-Image is not guidance-distilled (no guidance embedding).
    * Prompt embeddings are stored padded to ``max_sequence_length`` with their mask (``prompt_embeds_mask``; the
      negative prompt's at its own length); each transformer call gets them cut to the longest prompt of its batch
      and no mask when nothing is padded, exactly the tensors ``pipe()`` passes for the same batch.
    * Latents are stored unpacked, (C, H / s, W / s) with ``s = pipe.vae_scale_factor`` (the VAE's frame dim dropped);
      every transformer call packs them into 2x2 patches with the pipeline's ``_pack_latents`` and unpacks the
      velocity. The transformer takes ``timestep / 1000``, as the pipeline passes it.
    * The sigmas are the pipeline's: ``linspace(1, 1 / K, K)``, shifted by ``mu = calculate_shift(image tokens)``
      through the scheduler (Qwen-Image's: exponential shift, ``shift_terminal`` 0.02).
    """

    #: The targets of diffusers' Qwen-Image LoRA script (examples/dreambooth/train_dreambooth_lora_qwen_image.py,
    #: its default without ``--lora_layers``): the image-stream attention projections of every block.
    default_lora_target_modules = ("to_k", "to_q", "to_v", "to_out.0")
    #: ``pipe.encode_prompt`` pads a batch to its longest prompt.
    prompt_padding = "longest"

    def __init__(self, pipe, negative_prompt: str = " "):
        super().__init__(pipe)
        from diffusers import FlowMatchEulerDiscreteScheduler

        if pipe.transformer is None:
            raise ValueError("pipe: the QwenImagePipeline has no transformer")
        if pipe.transformer.config.get("guidance_embeds", False):
            raise ValueError("pipe: a guidance-distilled Qwen-Image transformer (guidance_embeds=True) is not "
                             "supported; Qwen-Image uses true CFG (guidance_scale here = the pipeline's "
                             "true_cfg_scale)")
        if not isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler):
            raise ValueError(f"pipe.scheduler: {type(pipe.scheduler).__name__}; the rollout needs the "
                             "FlowMatchEulerDiscreteScheduler Qwen-Image ships with")
        if not isinstance(negative_prompt, str):
            raise TypeError(f"negative_prompt: a string (default ' '), got {negative_prompt!r}")
        self.negative_prompt = negative_prompt
        self.max_sequence_length = 512  # the pipeline's default; configure() takes the trainer's
        self._warned_long = False

    @property
    def pipeline_class(self):
        from diffusers import QwenImagePipeline

        return QwenImagePipeline

    @property
    def resolution_multiple(self) -> int:
        return self.pipe.vae_scale_factor * 2  # VAE downsampling, then 2x2 packing

    def configure(self, config) -> None:
        if config.max_sequence_length > MAX_SEQUENCE_LENGTH:
            raise ValueError(f"max_sequence_length={config.max_sequence_length}: QwenImagePipeline takes at most "
                             f"{MAX_SEQUENCE_LENGTH} prompt tokens")
        self.max_sequence_length = config.max_sequence_length

    def check_size(self, height, width) -> None:
        rows, cols = (height // self.resolution_multiple, width // self.resolution_multiple)
        first_text = max(rows // 2, cols // 2)
        if max(rows, cols) > ROPE_POSITIONS or first_text + self.max_sequence_length > ROPE_POSITIONS:
            raise ValueError(
                f"height={height}, width={width}: {rows} x {cols} image tokens; Qwen-Image's rotary embedding has "
                f"{ROPE_POSITIONS} positions for max(rows, cols) / 2 = {first_text} plus max_sequence_length="
                f"{self.max_sequence_length} text tokens: pass a smaller size (the model card's 1:1 size is 1328 x "
                f"1328)")

    def latent_shape(self, height, width):
        s = self.pipe.vae_scale_factor
        return (self.transformer.config.in_channels // 4, 2 * (height // (2 * s)), 2 * (width // (2 * s)))

    # ------------------------------------------------------------------------------------------- prompts
    def encode_prompts(self, prompts, guidance, max_sequence_length=512) -> PromptEmbeds:
        """``prompt_embeds`` (B, max_sequence_length, D) zero-padded and ``prompt_embeds_mask`` (B,
        max_sequence_length) long, as ``pipe.encode_prompt`` makes them (padded so that batches concatenate); with
        ``guidance`` (the trainer's ``guidance_scale > 1``) the same for the negative prompt, whose embeddings keep
        their own length (one prompt: every batch has the same)."""
        prompts = list(prompts)
        out = dict(zip(("prompt_embeds", "prompt_embeds_mask"), self._encode(prompts, max_sequence_length, True)))
        if guidance:
            neg = self._encode([self.negative_prompt] * len(prompts), max_sequence_length, False)
            out.update(zip(("negative_prompt_embeds", "negative_prompt_embeds_mask"), neg))
        return out

    def prompt_token_limits(self, max_sequence_length) -> dict[str, int]:
        """``pipe.encode_prompt`` keeps ``max_sequence_length`` tokens of the templated prompt after its system prefix
        (the tokenizer cuts at ``pipe.tokenizer_max_length``), without a word."""
        return {"tokenizer": min(max_sequence_length, self.pipe.tokenizer_max_length)}

    def prompt_token_counts(self, prompts, name) -> list[int]:
        """The prompt's tokens with the template's closing tokens (the system prefix dropped), as the pipeline cuts."""
        pipe = self.pipe
        ids = pipe.tokenizer([pipe.prompt_template_encode.format(p) for p in prompts]).input_ids
        return [len(x) - pipe.prompt_template_encode_start_idx for x in ids]

    def _encode(self, prompts, max_sequence_length, pad: bool):
        pe, mask = self.pipe.encode_prompt(prompt=prompts, device=self.device, max_sequence_length=max_sequence_length)
        b, n, _ = pe.shape
        if mask is None:  # the pipeline drops an all-ones mask
            mask = torch.ones(b, n, dtype=torch.long, device=pe.device)
        if not pad:
            return pe, mask
        n_pad = max_sequence_length - n
        return torch.nn.functional.pad(pe, (0, 0, 0, n_pad)), torch.nn.functional.pad(mask, (0, n_pad))

    @staticmethod
    def _text(embeds, name):
        """The stored embeddings cut to the longest prompt of this batch, and the mask (None when nothing is
        padded), as ``pipe()`` passes them."""
        mask = embeds[f"{name}_mask"]
        n = int(mask.sum(dim=1).max())
        mask = mask[:, :n]
        return embeds[name][:, :n], (None if bool(mask.all()) else mask)

    # ------------------------------------------------------------------------------------------- sampling
    def schedule(self, num_inference_steps, height, width) -> Schedule:
        _, h, w = self.latent_shape(height, width)  # QwenImagePipeline: always the linear sigmas, then FLUX's shift
        sigmas = np.linspace(1.0, 1 / num_inference_steps, num_inference_steps)
        return shifted_schedule(self.pipe.scheduler, num_inference_steps, (h // 2) * (w // 2), self.device, sigmas)

    def velocity(self, model, x, timestep, embeds, guidance_scale, detach_uncond=False) -> torch.Tensor:
        pipe = self.pipe
        dtype = self.transformer.dtype
        b, c, h, w = x.shape
        latents = pipe._pack_latents(x.to(dtype), b, c, h, w)
        hidden, img_shapes = self._image_tokens(latents, h, w, embeds)
        n = latents.shape[1]
        t = torch.as_tensor(timestep, device=x.device)
        t = (t.expand(b) if t.ndim == 0 else t).to(dtype)

        def call(name):
            text, mask = self._text(embeds, name)
            return model(hidden_states=hidden, timestep=t / 1000, guidance=None, encoder_hidden_states_mask=mask,
                         encoder_hidden_states=text.to(dtype), img_shapes=img_shapes, attention_kwargs={},
                         return_dict=False)[0][:, :n]

        v = call("prompt_embeds")
        if guidance_scale > 1 and "negative_prompt_embeds" in embeds:
            v_neg = call("negative_prompt_embeds")
            if detach_uncond:
                v_neg = v_neg.detach()
            combined = v_neg + guidance_scale * (v - v_neg)
            # the pipeline's rescaling: each token's combined prediction gets the norm of the conditional one
            v = combined * (torch.norm(v, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True))
        s = pipe.vae_scale_factor
        return pipe._unpack_latents(v, h * s, w * s, s)[:, :, 0].float()

    def _image_tokens(self, latents, h, w, embeds):
        """The transformer's image tokens and ``img_shapes`` for the packed latents (B, n, 4C) of (C, h, w)
        latents: the generated image's alone (the editing adapter appends the source's after them)."""
        return latents, [[(1, h // 2, w // 2)]] * latents.shape[0]

    def decode(self, latents) -> torch.Tensor:
        """Images (B, 3, H, W) float32 in [0, 1] from latents (B, C, h, w): the VAE's per-channel
        ``latents_mean`` / ``latents_std``, one frame in and out, as the pipeline decodes."""
        vae = self.pipe.vae
        z = latents.to(vae.dtype)[:, :, None]  # (B, C, 1, h, w)
        mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(z.device, z.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(z.device, z.dtype)
        image = vae.decode(z / inv_std + mean, return_dict=False)[0][:, :, 0]
        return (image.float() / 2 + 0.5).clamp(0, 1)

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        """(B, C, h, w) latents -> the pipeline's packed (B, (h / 2) (w / 2), 4C) (``pipe(latents=...)``, and what
        ``pipe(output_type="latent")`` returns)."""
        b, c, h, w = latents.shape
        return self.pipe._pack_latents(latents, b, c, h, w)
