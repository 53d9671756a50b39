"""Adapter for ``QwenImage21Pipeline`` (Qwen-Image 2.1: one model for text-to-image generation and, with a source
image, editing)."""

from __future__ import annotations

import warnings

import numpy as np
import torch

from .base import FlowAdapter, PromptEmbeds, Schedule
from .editing import SOURCE_SIZES, SourceImageMixin
from .flux import shifted_schedule

#: The pipeline's default ``output_resolution``: a source image is resized to this side squared's area.
OUTPUT_RESOLUTION = 1024


def _dimensions(area: int, width: int, height: int) -> tuple[int, int]:
    """(height, width) of ``area`` pixels at the aspect ratio width / height, multiples of 32: the pipeline's
    ``calculate_dimensions``."""
    from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_dimensions

    w, h, _ = calculate_dimensions(area, width / height)
    return int(h), int(w)


class QwenImage21Adapter(SourceImageMixin, FlowAdapter):
    """Qwen-Image 2.1: Qwen3-VL conditioning, ``QwenImage21Transformer2DModel`` (single-stream, block-causal),
    ``AutoencoderKLQwenImage21`` (RGBA, 16x, 64 channels).

    * **Generation or editing, as the dataset says.** A trainer given the pipeline edits when its train dataset has
      a ``source_image`` column and generates from text otherwise (:meth:`choose_conditioning`; the eval dataset
      must agree); ``conditions_on_source=True`` / ``False`` fixes the mode (outside a trainer the adapter generates
      unless it is True). Editing conditions each sample on its source as ``pipe(image=source)`` does: the source,
      resized to ``source_size``'s area at its aspect ratio in multiples of 32, goes through the vision-language
      encoder with the prompt (its ``<|image_pad|>`` slots marked in ``image_pad_mask``) and, VAE-encoded, is
      stored as ``image_latents`` (B, C, h', w'), its tokens placed *before* the generated ones in every
      transformer call; only the generated tokens' velocity is kept. ``source_size``: ``"auto"``
      (``output_resolution`` squared, the pipeline's argument of that name, default 1024: about 1 MP),
      ``"output"`` (height x width's area, Flow-Factory's ``condition_image_size``) or ``"source"``.
    * Prompts (and the negative prompt, encoded with the same source) are encoded by ``pipe.encode_prompt``: the
      raw chat template, its system prefix dropped; stored zero-padded to ``max_sequence_length`` (template tokens
      included) with ``prompt_embeds_mask`` and ``image_pad_mask``, cut to the batch's longest for each call (no
      mask when nothing is padded), as the pipeline passes them. The pipeline does not cut prompts: a longer one
      is cut here, with one warning. Qwen3-VL's rotary positions follow the (left) padding of the batch, so a
      prompt's embedding depends on its batch: the trainer encodes each sampling chunk once
      (``prompt_padding="longest"``); with a source each sample is encoded alone.
    * Guidance is the pipeline's true CFG (``guidance_scale`` = ``true_cfg_scale``; Qwen-Image 2.1 is meant to be
      sampled at 1, one pass): above 1, ``v_neg + s (v - v_neg)`` with ``negative_prompt`` (default ``" "``), no
      rescaling.
    * Latents (C, H / 16, W / 16), one token each (the pipeline's ``_pack_latents`` is a flatten); sigmas are the
      pipeline's ``sample_sigmas`` (its config; then ``num_inference_steps`` must be their count) or
      ``linspace(1, 1 / K, K)``, shifted by ``mu = calculate_shift(tokens)``; the transformer gets ``t / 1000``.
    * The pipeline caches the text and source keys / values after the first step (``use_kv_cache``, default on);
      the trainer recomputes them every step (the LoRA changes them). In float32 the two agree to rounding, not bit
      for bit (the pipeline's docstring says so): the parity is with ``pipe(use_kv_cache=False)``.
    * Decode: the VAE's RGBA output; the rewards get its RGB channels (what ``Image.convert("RGB")`` of the
      pipeline's PIL image holds).
    """

    #: Qwen-Image's targets (diffusers' Qwen-Image LoRA script): the attention projections of every block.
    default_lora_target_modules = ("to_k", "to_q", "to_v", "to_out.0")
    prompt_padding = "longest"
    pipeline_tag = "text-to-image"

    def __init__(self, pipe, negative_prompt: str = " ", conditions_on_source: bool | None = None,
                 source_size: str | None = None, source_column: str = "source_image",
                 output_size: tuple[int, int] | None = None, output_resolution: int = OUTPUT_RESOLUTION):
        super().__init__(pipe)
        if isinstance(output_resolution, bool) or not isinstance(output_resolution, int) or output_resolution < 32:
            raise ValueError(f"output_resolution={output_resolution!r}: an int >= 32 (the pipeline's default: 1024)")
        self.output_resolution = output_resolution
        if pipe.transformer is None:
            raise ValueError("pipe: the QwenImage21Pipeline has no transformer")
        if not isinstance(negative_prompt, str):
            raise TypeError(f"negative_prompt: a string (default ' '), got {negative_prompt!r}")
        self.negative_prompt = negative_prompt
        self.max_sequence_length = 512
        self._warned_long = False
        if conditions_on_source not in (None, True, False):
            raise ValueError(f"conditions_on_source={conditions_on_source!r}: True (edit), False (generate) or None "
                             "(the trainer's dataset decides)")
        if source_size is not None and conditions_on_source is False:
            raise ValueError(f"source_size={source_size!r}: only for editing (conditions_on_source=True or None)")
        self._conditions_on_source = conditions_on_source
        self._set_conditioning(bool(conditions_on_source))
        self._chosen_by = None  # the dataset that chose the mode (conditions_on_source=None)
        self._init_source(source_size, source_column, output_size)

    def _set_conditioning(self, edit: bool) -> None:
        self.conditioning = "text_and_image" if edit else "text"
        self.pipeline_tag = "image-to-image" if edit else "text-to-image"

    @property
    def reads_config_fields(self):
        return () if self._conditions_on_source is False else ("source_image_size",)

    def choose_conditioning(self, has_sources: bool, name: str) -> None:
        """Called by the trainer with each of its datasets (:func:`trl_flow.editing.check_dataset_for`): with
        ``conditions_on_source=None`` the first dataset's ``source_image`` column decides between generation and
        editing, and a later dataset must agree; a fixed mode is left to the usual checks."""
        if self._conditions_on_source is not None:
            return
        if self._chosen_by is None:
            self._chosen_by = name
            self._set_conditioning(has_sources)
            if not has_sources and self.source_size != "auto":
                raise ValueError(f"source_image_size={self.source_size!r}: applies to editing, but {name} has no "
                                 f"`{self.source_column}` column (QwenImage21Pipeline then generates from text); "
                                 "add the column or leave source_image_size='auto'")
        elif has_sources != (self.conditioning == "text_and_image"):
            raise ValueError(
                f"{name}: {'has' if has_sources else 'has no'} `{self.source_column}` column but {self._chosen_by} "
                f"{'does not' if has_sources else 'does'}: Qwen-Image 2.1 edits when the train dataset has source "
                "images and generates when it has none; give both datasets the same columns")

    @property
    def pipeline_class(self):
        from diffusers import QwenImage21Pipeline

        return QwenImage21Pipeline

    @property
    def resolution_multiple(self) -> int:
        return self.pipe.vae_scale_factor * 2  # the pipeline rounds height and width down to multiples of 32

    def configure(self, config) -> None:
        super().configure(config)
        self.max_sequence_length = config.max_sequence_length
        self._check_steps(config.num_inference_steps, "num_inference_steps")
        if getattr(config, "eval_num_inference_steps", None):
            self._check_steps(config.eval_num_inference_steps, "eval_num_inference_steps")

    def _check_steps(self, k: int, name: str) -> None:
        sigmas = self.pipe.config.get("sample_sigmas")
        if sigmas is not None and k != len(sigmas):
            raise ValueError(f"{name}={k}: this QwenImage21Pipeline samples its configured sample_sigmas, "
                             f"{len(sigmas)} steps; set {name}={len(sigmas)} (or set pipe.register_to_config("
                             "sample_sigmas=None) to use linspace(1, 1/K, K))")

    def latent_shape(self, height, width):
        s = self.pipe.vae_scale_factor
        return (self.pipe.vae.config.z_dim, 2 * (height // (2 * s)), 2 * (width // (2 * s)))

    # ------------------------------------------------------------------------------------------- the source
    def source_size_of(self, image) -> tuple[int, int]:
        """(height, width) the source is resized to (a PIL image, or its (width, height))."""
        width, height = image if isinstance(image, tuple) else image.size
        if self.source_size == "auto":
            area = self.output_resolution * self.output_resolution
        elif self.source_size == "source":
            area = width * height
        else:
            h, w = self._need_output_size()
            area = h * w
        size = _dimensions(area, width, height)
        if min(size) < 32:
            raise ValueError(f"a {width}x{height} px source at source_size={self.source_size!r} is resized to "
                             f"{size[1]}x{size[0]} px; its sides must come out >= 32 px: use a larger or less "
                             "elongated source")
        return size

    def source_inputs(self, image):
        """What ``pipe()`` makes of one source: the vision-language encoder's image (RGBA PIL) and the VAE's input
        (1, 4, 1, h, w) in [-1, 1] (``__call__`` step 1)."""
        ip = self.pipe.image_processor
        h, w = self.source_size_of(image)
        if image.mode != "RGBA":
            image = image.convert("RGBA")
        return ip.resize(image, width=w, height=h), ip.preprocess(image, width=w, height=h).unsqueeze(2)

    # ------------------------------------------------------------------------------------------- prompts
    def prompt_token_limits(self, max_sequence_length) -> dict[str, int]:
        """None for the trainer's check: the pipeline does not cut prompts; :meth:`encode_prompts` cuts the
        embedding and warns itself."""
        return {}

    def encode_prompts(self, prompts, guidance, max_sequence_length=512, images=None) -> PromptEmbeds:
        prompts = list(prompts)
        if self.conditioning == "text":
            if images is not None:
                raise ValueError("QwenImage21Adapter: images= given to a generation adapter; build it with "
                                 "conditions_on_source=True to edit")
            out = self._encode(prompts, None, max_sequence_length, "prompt_embeds")
            if guidance:
                out.update(self._encode([self.negative_prompt] * len(prompts), None, max_sequence_length,
                                        "negative_prompt_embeds"))
            return out
        if images is None or len(images) != len(prompts):
            raise ValueError(f"{type(self).__name__}: encode_prompts needs images= with one source image per prompt "
                             f"({len(prompts)} prompts, {None if images is None else len(images)} images)")
        sizes = {self.source_size_of(im) for im in images}
        if len(sizes) > 1:
            raise ValueError(f"source images: the batch mixes conditioning sizes {sorted(sizes)} "
                             f"(source_size={self.source_size!r}); resize the sources to one size or aspect ratio")
        memo, rows = {}, []
        for prompt, image in zip(prompts, images):
            key = (prompt, id(image))
            if key not in memo:
                vl_image, vae_image = self.source_inputs(image)
                row = self._encode([prompt], vl_image, max_sequence_length, "prompt_embeds")
                if guidance:
                    row.update(self._encode([self.negative_prompt], vl_image, max_sequence_length,
                                            "negative_prompt_embeds"))
                dtype = row["prompt_embeds"].dtype  # the pipeline encodes the source in the embeddings' dtype
                latents = self.pipe._encode_vae_image(vae_image.to(self.device, dtype=dtype), None)
                row["image_latents"] = latents[:, :, 0]
                memo[key] = row
            rows.append(memo[key])
        return {k: torch.cat([r[k] for r in rows]) for k in rows[0]}

    def _encode(self, prompts, vl_image, max_sequence_length, name) -> PromptEmbeds:
        """``pipe.encode_prompt`` of a batch (with its source), padded to ``max_sequence_length``."""
        pe, mask, pad_mask = self.pipe.encode_prompt(prompt=prompts, image=None if vl_image is None else [vl_image],
                                                     device=self.device)
        b, n, _ = pe.shape
        if mask is None:  # the pipeline drops an all-ones mask
            mask = torch.ones(b, n, dtype=torch.long, device=pe.device)
        if n > max_sequence_length:
            if not self._warned_long:
                self._warned_long = True
                warnings.warn(
                    f"a prompt has {int(mask.sum(dim=1).max())} tokens with the template (its system prefix dropped; "
                    f"the source's vision tokens included), more than max_sequence_length={max_sequence_length}; "
                    "QwenImage21Pipeline does not cut prompts, the trainer cuts the embedding there (the samples then "
                    "differ from pipe()'s); raise max_sequence_length or shorten the prompts. Reported once.",
                    UserWarning, stacklevel=4)
            pe, mask, pad_mask = pe[:, :max_sequence_length], mask[:, :max_sequence_length], pad_mask[
                :, :max_sequence_length]
        pad = max_sequence_length - pe.shape[1]
        return {name: torch.nn.functional.pad(pe, (0, 0, 0, pad)),
                f"{name}_mask": torch.nn.functional.pad(mask.long(), (0, pad)),
                f"{name}_image_pad_mask": torch.nn.functional.pad(pad_mask, (0, pad))}

    # ------------------------------------------------------------------------------------------- sampling
    def schedule(self, num_inference_steps, height, width) -> Schedule:
        self._check_steps(num_inference_steps, "num_inference_steps")
        _, h, w = self.latent_shape(height, width)
        sigmas = self.pipe.config.get("sample_sigmas")
        if sigmas is None:
            sigmas = np.linspace(1.0, 1 / num_inference_steps, num_inference_steps)
        return shifted_schedule(self.pipe.scheduler, num_inference_steps, h * w, self.device, sigmas)

    def velocity(self, model, x, timestep, embeds, guidance_scale, detach_uncond=False) -> torch.Tensor:
        pipe = self.pipe
        dtype = self.transformer.dtype
        b, c, h, w = x.shape
        latents = pipe._pack_latents(x.to(dtype), b, c, h, w)  # (B, h w, C)
        n = latents.shape[1]
        img_shapes = [(1, h, w)]
        hidden = latents
        if "image_latents" in embeds:  # the source's tokens first, as pipe(image=...) places them
            cond = embeds["image_latents"].to(dtype)
            hc, wc = cond.shape[2:]
            hidden = torch.cat([pipe._pack_latents(cond, b, c, hc, wc), latents], dim=1)
            img_shapes = [(1, hc, wc)] + img_shapes
        t = torch.as_tensor(timestep, device=x.device)
        t = (t.expand(b) if t.ndim == 0 else t).to(dtype)

        def call(name):
            mask = embeds[f"{name}_mask"]
            k = int(mask.sum(dim=1).max())  # cut to the batch's longest, as pipe() pads
            mask = mask[:, :k]
            pad_mask = embeds[f"{name}_image_pad_mask"][:, :k]
            img_mask = torch.cat([pad_mask, pad_mask.new_ones(b, n // 4)], dim=1)  # one slot per 2x2 target group
            return model(hidden_states=hidden, timestep=t / 1000, encoder_hidden_states=embeds[name][:, :k].to(dtype),
                         encoder_hidden_states_mask=None if bool(mask.all()) else mask,
                         img_shapes=[img_shapes] * b, img_mask=img_mask, attention_kwargs={}, kv_cache=None,
                         kv_cache_mode=None, return_dict=False)[0][:, -n:]

        v = call("prompt_embeds")
        if guidance_scale > 1 and "negative_prompt_embeds" in embeds:
            v_neg = call("negative_prompt_embeds")
            if detach_uncond:
                v_neg = v_neg.detach()
            v = v_neg + guidance_scale * (v - v_neg)
        return v.transpose(1, 2).reshape(b, c, h, w).float()

    def decode(self, latents) -> torch.Tensor:
        """Images (B, 3, H, W) float32 in [0, 1]: the pipeline's decode (``latents * std + mean``, one frame), the
        RGB channels of its RGBA output."""
        vae = self.pipe.vae
        z = latents.to(vae.dtype)[:, :, None]
        mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(z.device, z.dtype)
        std = torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(z.device, z.dtype)
        image = vae.decode(z * std + mean, return_dict=False)[0][:, :, 0]
        return (image[:, :3].float() / 2 + 0.5).clamp(0, 1)

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        """(B, C, h, w) -> the pipeline's (B, h w, C) (what ``pipe(output_type="latent")`` returns)."""
        b, c, h, w = latents.shape
        return self.pipe._pack_latents(latents, b, c, h, w)


__all__ = ["QwenImage21Adapter", "SOURCE_SIZES"]
