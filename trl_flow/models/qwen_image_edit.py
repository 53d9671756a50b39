"""Qwen-Image-Edit (image editing): Qwen-Image's adapter plus the source image, as ``QwenImageEditPipeline`` and
``QwenImageEditPlusPipeline`` (Qwen-Image-Edit-2509 / -2511) condition on it."""

from __future__ import annotations

import warnings

import torch

from .base import PromptEmbeds
from .editing import SOURCE_SIZES, SourceImageMixin  # noqa: F401 (SOURCE_SIZES: re-exported)
from .qwen_image import QwenImageAdapter
#: The area (pixels) both pipelines resize the VAE's source image to, at the source's aspect ratio (1 MP).
VAE_IMAGE_AREA = 1024 * 1024


def _dimensions(area: int, width: int, height: int) -> tuple[int, int]:
    """(height, width) of ``area`` pixels at the aspect ratio width / height, multiples of 32: the pipelines'
    ``calculate_dimensions``."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

    w, h, *_ = calculate_dimensions(area, width / height)
    return int(h), int(w)


class QwenImageEditAdapter(SourceImageMixin, QwenImageAdapter):
    """Qwen-Image-Edit: ``QwenImageEditPipeline``, an editing model (``conditioning="text_and_image"``). Everything of
    :class:`QwenImageAdapter` applies (true CFG with the norm rescaling, negative prompt ``" "``, schedule shifted by
    the generated tokens only, decode, LoRA targets); the source conditions twice, as in the pipeline:

    * **Vision-language prompt.** The source, resized (``image_processor.resize``) to the size below, goes with the
      prompt through ``pipe.encode_prompt(image=...)``: the editing chat template (its 64-token system prefix
      dropped) whose ``<|image_pad|>`` the ``Qwen2VLProcessor`` expands into the source's vision tokens, encoded by
      Qwen2.5-VL with its vision tower. The negative prompt is encoded with the same source. Each sample is encoded
      on its own (its conditioning does not depend on its batch; repeated (prompt, source) pairs are encoded once);
      the embeddings are stored padded to (vision and template tokens) + ``max_sequence_length`` with their mask.
      The pipeline does not cut prompts: a longer one is cut here to that length, with one warning.
    * **Image latents.** The same resized source, VAE-encoded (the distribution's mode, normalised by the VAE's
      ``latents_mean`` / ``latents_std``) is stored unpacked as ``image_latents`` (B, C, h', w'); every transformer
      call packs it into (h'/2)(w'/2) tokens after the generated ones, passes
      ``img_shapes = [[(1, h/2, w/2), (1, h'/2, w'/2)]]`` per sample and keeps only the generated tokens' velocity.
    * ``source_size`` (or the trainer config's ``source_image_size``) sets the area the source is resized to, at its
      own aspect ratio, in multiples of 32 (the pipeline's ``calculate_dimensions``): ``"auto"`` the pipeline's
      1024 x 1024 (4096 source tokens with the real 8x VAE), ``"output"`` the generated height x width (Flow-Factory's
      ``condition_image_size``; a square source at a square output is resized to exactly height x width),
      ``"source"`` the source's own area. Every row must give the same conditioning size (checked at set-up).
    """

    #: Each sample is encoded alone, so its embedding depends on nothing else of its batch (the trainer may encode
    #: each distinct (prompt, source) once).
    prompt_padding = "max_length"
    #: Area (pixels) of the image the vision-language encoder sees; None: the VAE's image (QwenImageEditPipeline).
    vl_image_area: int | None = None

    def __init__(self, pipe, negative_prompt: str = " ", source_size: str | None = None,
                 source_column: str = "source_image", output_size: tuple[int, int] | None = None):
        super().__init__(pipe, negative_prompt=negative_prompt)
        if getattr(pipe, "processor", None) is None:
            raise ValueError(f"pipe: the {type(pipe).__name__} has no processor (Qwen2VLProcessor); the source "
                             "image's vision tokens need it")
        self._init_source(source_size, source_column, output_size)

    @property
    def pipeline_class(self):
        from diffusers import QwenImageEditPipeline

        return QwenImageEditPipeline

    def lora_load_code(self, source: str) -> str:
        return f'pipe.load_lora_weights("{source}")  # pipe = {self.pipeline_class.__name__}.from_pretrained(...)'

    # ------------------------------------------------------------------------------------------- the source
    def source_size_of(self, image) -> tuple[tuple[int, int], tuple[int, int]]:
        """((height, width) of the VAE's image, (height, width) of the vision-language encoder's) for ``image`` (a
        PIL image, or its (width, height))."""
        width, height = image if isinstance(image, tuple) else image.size
        if self.source_size == "auto":
            area = VAE_IMAGE_AREA
        elif self.source_size == "source":
            area = width * height
        else:
            height_out, width_out = self._need_output_size()
            area = height_out * width_out
        vae = _dimensions(area, width, height)
        if min(vae) < 32:
            raise ValueError(f"a {width}x{height} px source at source_size={self.source_size!r} is resized to "
                             f"{vae[1]}x{vae[0]} px; its sides must come out >= 32 px: use a larger or less elongated "
                             "source")
        vl = vae if self.vl_image_area is None else _dimensions(self.vl_image_area, width, height)
        return vae, vl

    def _vae_size(self, key) -> tuple[int, int]:
        return key[0]  # (vae, vision-language) sizes: the message names the VAE's

    def source_inputs(self, image):
        """What the pipeline makes of one source (an RGB PIL image): the vision-language encoder's image (PIL) and the
        VAE's input (1, 3, 1, h, w) in [-1, 1]."""
        ip = self.pipe.image_processor
        (h, w), (hv, wv) = self.source_size_of(image)
        resized = ip.resize(image, h, w)
        if self.vl_image_area is None:  # QwenImageEditPipeline: one resized image for both
            return resized, ip.preprocess(resized, h, w).unsqueeze(2)
        return ip.resize(image, hv, wv), ip.preprocess(image, h, w).unsqueeze(2)

    # ------------------------------------------------------------------------------------------- prompts
    def prompt_token_limits(self, max_sequence_length) -> dict[str, int]:
        """None for the trainer's check: the editing pipeline does not cut prompts; :meth:`encode_prompts` cuts the
        embedding and warns itself."""
        return {}

    def encode_prompts(self, prompts, guidance, max_sequence_length=512, images=None) -> PromptEmbeds:
        """``prompt_embeds`` (B, T, D) zero-padded with ``prompt_embeds_mask`` (B, T), T = the vision and template
        tokens + ``max_sequence_length``; with ``guidance`` the negative prompt's (at their own length, the same for
        every sample); ``image_latents`` (B, C, h', w'). ``images``: one RGB PIL source per prompt."""
        prompts = list(prompts)
        if images is None or len(images) != len(prompts):
            raise ValueError(f"{type(self).__name__}: encode_prompts needs images= with one source image per prompt "
                             f"({len(prompts)} prompts, {None if images is None else len(images)} images)")
        sizes = {self.source_size_of(im) for im in images}
        if len(sizes) > 1:
            raise ValueError(f"source images: the batch mixes conditioning sizes {sorted(s[0] for s in sizes)} "
                             f"(source_size={self.source_size!r}); resize the sources to one size or aspect ratio")
        memo, rows = {}, []
        for prompt, image in zip(prompts, images):
            key = (prompt, id(image))
            if key not in memo:
                memo[key] = self._encode_one(prompt, image, guidance, max_sequence_length)
            rows.append(memo[key])
        return {k: torch.cat([r[k] for r in rows]) for k in rows[0]}

    def _encode_one(self, prompt, image, guidance, max_sequence_length) -> PromptEmbeds:
        pipe = self.pipe
        vl_image, vae_image = self.source_inputs(image)
        pe, mask = self._encode_vl(prompt, vl_image)
        n_prompt = len(pipe.tokenizer(prompt).input_ids)
        length = pe.shape[1] - n_prompt + max_sequence_length
        if pe.shape[1] > length:
            self._warn_long(prompt, n_prompt, max_sequence_length)
            pe, mask = pe[:, :length], mask[:, :length]
        pad = length - pe.shape[1]
        out = {"prompt_embeds": torch.nn.functional.pad(pe, (0, 0, 0, pad)),
               "prompt_embeds_mask": torch.nn.functional.pad(mask, (0, pad))}
        if guidance:
            out["negative_prompt_embeds"], out["negative_prompt_embeds_mask"] = self._encode_vl(self.negative_prompt,
                                                                                                vl_image)
        # the pipeline encodes the source in the prompt embeddings' dtype (prepare_latents), one frame
        latents = pipe._encode_vae_image(image=vae_image.to(device=self.device, dtype=pe.dtype), generator=None)
        out["image_latents"] = latents[:, :, 0]
        return out

    def _encode_vl(self, prompt, vl_image):
        """``pipe.encode_prompt`` of one prompt with its source: (1, n, D) and a (1, n) mask of ones."""
        pe, mask = self.pipe.encode_prompt(prompt=[prompt], image=[vl_image], device=self.device)
        return pe, (torch.ones(pe.shape[:2], dtype=torch.long, device=pe.device) if mask is None else mask)

    def _warn_long(self, prompt, n_prompt, max_sequence_length) -> None:
        if not getattr(self, "_warned_long", False):  # QwenImageAdapter's flag (warned once per adapter)
            self._warned_long = True
            warnings.warn(
                f"a prompt has {n_prompt} tokens, more than max_sequence_length={max_sequence_length} (e.g. "
                f"{prompt[:80]!r}); {type(self.pipe).__name__} does not cut prompts, the trainer cuts its embedding "
                f"there (the samples then differ from pipe()'s); raise max_sequence_length or shorten the prompts. "
                "Reported once.", UserWarning, stacklevel=4)

    # --------------------------------------------------------------------------------------------- velocity
    def _image_tokens(self, latents, h, w, embeds):
        """The generated tokens, then the source's (its packed ``image_latents``), and both shapes."""
        cond = embeds["image_latents"].to(latents.dtype)
        b, c, hc, wc = cond.shape
        tokens = self.pipe._pack_latents(cond, b, c, hc, wc)
        return torch.cat([latents, tokens], dim=1), [[(1, h // 2, w // 2), (1, hc // 2, wc // 2)]] * b


class QwenImageEditPlusAdapter(QwenImageEditAdapter):
    """Qwen-Image-Edit-2509 / -2511: ``QwenImageEditPlusPipeline``. The same as :class:`QwenImageEditAdapter` but
    for what the pipeline does differently with one source: the template's user turn starts with
    ``"Picture 1: <|vision_start|><|image_pad|><|vision_end|>"``, and the vision-language encoder sees the source
    resized to 384 x 384 pixels' area (the pipeline's ``CONDITION_IMAGE_SIZE``) while the VAE's image follows
    ``source_size``. One source image per prompt (the pipeline's multi-image input is not supported)."""

    vl_image_area = 384 * 384  # the pipeline's CONDITION_IMAGE_SIZE

    @property
    def pipeline_class(self):
        from diffusers import QwenImageEditPlusPipeline

        return QwenImageEditPlusPipeline
