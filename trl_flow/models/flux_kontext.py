"""FLUX.1 Kontext (image editing): FLUX.1's adapter plus the source image's tokens, as ``FluxKontextPipeline``."""

from __future__ import annotations

import torch

from .base import PromptEmbeds
from .editing import SOURCE_SIZES, SourceImageMixin  # noqa: F401 (SOURCE_SIZES: re-exported)
from .flux import FluxAdapter


class FluxKontextAdapter(SourceImageMixin, FluxAdapter):
    """FLUX.1 Kontext: ``FluxKontextPipeline``, an editing model (``conditioning="text_and_image"``).

    * The source image is processed as the pipeline's step 3 does (``image_processor.resize`` + ``preprocess`` at
      the size below), encoded by the VAE (the distribution's mode), shifted and scaled; the result is stored
      *unpacked* in the prompt embeddings under the pipeline's own argument name ``image`` (B, C, h', w'), so
      ``pipe(**embeds)`` takes it and ``index_embeds`` / ``cat_embeds`` / checkpoints treat it like the text.
    * :meth:`velocity` packs it into (h'/2)(w'/2) tokens, concatenates them after the noisy latent's tokens with
      their ids (the latent's ids with the first coordinate set to 1) and keeps only the generated tokens'
      velocity, exactly as the denoising loop does.
    * ``source_size`` (or the trainer config's ``source_image_size``): ``"auto"`` (the pipeline's default
      ``_auto_resize=True``: the preferred Kontext resolution nearest the source's aspect ratio, about 1024 x 1024
      pixels), ``"source"`` (``_auto_resize=False``: the source's own size, rounded down to a multiple of 16) or
      ``"output"`` (resized to the generated height x width, as Flow-GRPO's Kontext training does; equals
      ``pipe(image=image_processor.resize(source, H, W), _auto_resize=False)``). The conditioning's shape must be
      the same for every sample of a run (one aspect-ratio class under ``"auto"``, one size under ``"source"``):
      rows that differ are refused at set-up, naming them.
    * Everything else (distilled guidance, true CFG, schedule, decode, LoRA targets) is FLUX.1's. The schedule's
      shift uses the generated tokens only, as the pipeline does.
    """

    def __init__(self, pipe, true_cfg_scale: float = 1.0, negative_prompt: str | None = None,
                 source_size: str | None = None, source_column: str = "source_image",
                 output_size: tuple[int, int] | None = None):
        super().__init__(pipe, true_cfg_scale=true_cfg_scale, negative_prompt=negative_prompt)
        self._init_source(source_size, source_column, output_size)

    @property
    def pipeline_class(self):
        from diffusers import FluxKontextPipeline

        return FluxKontextPipeline

    def lora_load_code(self, source: str) -> str:
        return f'pipe.load_lora_weights("{source}")  # pipe = FluxKontextPipeline.from_pretrained(...)'

    # ------------------------------------------------------------------------------------------- conditioning
    def source_size_of(self, image) -> tuple[int, int]:
        """(height, width) in pixels the pipeline encodes ``image`` (a PIL image, or its (width, height)) at."""
        from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

        multiple_of = self.pipe.vae_scale_factor * 2
        if self.source_size == "output":
            height, width = self._need_output_size()
            return height // multiple_of * multiple_of, width // multiple_of * multiple_of
        width, height = image if isinstance(image, tuple) else image.size
        h, w = self.pipe.image_processor.get_default_height_width(None, height=height, width=width)
        if self.source_size == "auto":
            _, w, h = min((abs(w / h - pw / ph), pw, ph) for pw, ph in PREFERRED_KONTEXT_RESOLUTIONS)
        return h // multiple_of * multiple_of, w // multiple_of * multiple_of

    def _same_size_hint(self) -> str:
        return " class" if self.source_size == "auto" else " and size"

    def encode_images(self, images, dtype) -> torch.Tensor:
        """(B, C, h', w') VAE latents of the sources, shifted and scaled as the pipeline's ``_encode_vae_image``;
        each image is encoded on its own (a sample's conditioning does not depend on its batch)."""
        if images is None:
            raise ValueError("FluxKontextAdapter: encode_prompts needs images= (one source image per prompt)")
        pipe = self.pipe
        sizes = [self.source_size_of(im) for im in images]
        if len(set(sizes)) > 1:
            raise ValueError(f"source images: the batch mixes conditioning sizes {sorted(set(sizes))} (source_size="
                             f"{self.source_size!r}); resize the sources to one size or aspect ratio")
        out = []
        for im, (h, w) in zip(images, sizes):
            x = pipe.image_processor.preprocess(pipe.image_processor.resize(im, h, w), h, w)
            out.append(pipe._encode_vae_image(image=x.to(device=self.device, dtype=dtype), generator=None))
        return torch.cat(out)

    def encode_prompts(self, prompts, guidance, max_sequence_length=512, images=None) -> PromptEmbeds:
        """FLUX.1's text conditioning plus ``image``: the sources' latents (B, C, h', w') (see the class)."""
        out = super().encode_prompts(prompts, guidance, max_sequence_length)
        if images is None or len(images) != len(prompts):
            raise ValueError(f"FluxKontextAdapter: encode_prompts needs images= with one source image per prompt "
                             f"({len(prompts)} prompts, {None if images is None else len(images)} images)")
        out["image"] = self.encode_images(images, out["prompt_embeds"].dtype)
        return out

    # --------------------------------------------------------------------------------------------- velocity
    def velocity(self, model, x, timestep, embeds, guidance_scale, detach_uncond=False) -> torch.Tensor:
        pipe = self.pipe
        dtype = self.transformer.dtype
        b, c, h, w = x.shape
        latents = pipe._pack_latents(x.to(dtype), b, c, h, w)
        cond = embeds["image"].to(dtype)
        hc, wc = cond.shape[-2:]
        cond_tokens = pipe._pack_latents(cond, b, cond.shape[1], hc, wc)
        hidden = torch.cat([latents, cond_tokens], dim=1)
        img_ids, txt_ids = self._kontext_ids(h, w, hc, wc, embeds["prompt_embeds"].shape[1], x.device, dtype)
        t = torch.as_tensor(timestep, device=x.device)
        t = (t.expand(b) if t.ndim == 0 else t).to(dtype)
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.full([b], guidance_scale, device=x.device, dtype=torch.float32)
        n = latents.shape[1]

        def call(prompt_embeds, pooled):
            return model(hidden_states=hidden, timestep=t / 1000, guidance=guidance, pooled_projections=pooled,
                         encoder_hidden_states=prompt_embeds, txt_ids=txt_ids, img_ids=img_ids,
                         return_dict=False)[0][:, :n]

        v = call(embeds["prompt_embeds"], embeds["pooled_prompt_embeds"])
        if self.true_cfg and "negative_prompt_embeds" in embeds:
            v_neg = call(embeds["negative_prompt_embeds"], embeds["negative_pooled_prompt_embeds"])
            if detach_uncond:
                v_neg = v_neg.detach()
            v = v_neg + self.true_cfg_scale * (v - v_neg)
        s = pipe.vae_scale_factor
        return pipe._unpack_latents(v, h * s, w * s, s).float()

    def _kontext_ids(self, h, w, hc, wc, text_len, device, dtype):
        """The pipeline's ids: the generated tokens' then the source's (first coordinate 1), and the text's."""
        key = ("kontext", h, w, hc, wc, text_len, device, dtype)
        if key not in self._ids_cache:
            img_ids, txt_ids = self._ids(h, w, text_len, device, dtype)
            cond_ids = self.pipe._prepare_latent_image_ids(1, hc // 2, wc // 2, device, dtype)
            cond_ids[..., 0] = 1
            self._ids_cache[key] = (torch.cat([img_ids, cond_ids], dim=0), txt_ids)
        return self._ids_cache[key]
