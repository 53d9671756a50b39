"""Adapter for ``WanImageToVideoPipeline``: Wan2.1-I2V (one transformer, CLIP image embedding) and Wan2.2-I2V-A14B
(two experts), image-to-video from the dataset's ``source_image`` column."""

from __future__ import annotations

import torch

from .base import PromptEmbeds
from .wan import WanAdapter


class WanImageToVideoAdapter(WanAdapter):
    """Wan image-to-video: ``WanImageToVideoPipeline`` in its channel-concatenation form. Everything of
    :class:`~trl_flow.models.wan.WanAdapter` applies (UMT5 prompt, two-pass CFG with ``negative_prompt``, the
    flow-matching scheduler swap, ``num_frames``, Wan2.2's two experts with ``experts`` / ``guidance_scale_2``, LoRA
    files and targets); the source image (``conditioning="text_and_image"``: the dataset's ``source_image``
    column, the video's first frame) conditions each sample as in ``pipe(image=...)``:

    * **Condition latents.** The source is resized to the generated height x width
      (``video_processor.preprocess``), followed by ``num_frames - 1`` black frames, VAE-encoded (the
      distribution's mode, normalised by ``latents_mean`` / ``latents_std``) and preceded by the 4-channel
      first-frame mask: ``pipe.prepare_latents`` builds it, and it is stored as ``condition`` (B, 4 + C, F', h, w)
      float32. Every transformer call gets ``cat([x, condition], dim=1)``, as the denoising loop does; the states,
      kernels and decode are those of the generated video (C channels).
    * **Image embedding** (Wan2.1-I2V only, a transformer with ``image_dim``): the CLIP vision tower's
      second-to-last hidden states of the source as it is (``pipe.encode_image``), stored as ``image_embeds`` and
      passed as ``encoder_hidden_states_image`` to both CFG branches, as the pipeline does.

    Each source is encoded on its own (a sample's conditioning does not depend on its batch; a source shared by
    several samples is encoded once). Every source is resized to the generated size, so any sizes mix (a source of
    another aspect ratio is stretched, as the pipeline does: resize or crop sources to the output's ratio first).
    Not supported, refused when the adapter is built: the ``expand_timesteps`` form (Wan2.2-TI2V-5B's
    image-to-video, whose first latent frame is the source rather than sampled; train it text-to-video with
    ``WanPipeline``) and ``last_image`` (first-last-frame conditioning: one source image per row here).
    """

    conditioning = "text_and_image"
    pipeline_tag = "image-to-video"

    def __init__(self, pipe, num_frames: int = 33, negative_prompt: str = "", guidance_scale_2: float | None = None,
                 experts: str | None = None, source_column: str = "source_image",
                 output_size: tuple[int, int] | None = None):
        if pipe.config.get("expand_timesteps", False):
            raise ValueError(
                "pipe: WanImageToVideoPipeline with expand_timesteps=True (Wan2.2-TI2V-5B's image-to-video) is not "
                "supported: its first latent frame is the source image, not sampled, so pipe() is not the Euler "
                "rollout trl_flow trains; train Wan2.2-TI2V-5B text-to-video (WanPipeline.from_pretrained(...)) or "
                "use Wan-AI/Wan2.2-I2V-A14B-Diffusers for image-to-video")
        import diffusers.pipelines.wan.pipeline_wan_i2v as i2v

        if not hasattr(i2v, "ftfy"):  # it calls ftfy.fix_text on every prompt without checking it is installed
            raise ImportError("WanImageToVideoPipeline cleans prompts with ftfy, which is not installed: pip install "
                              "ftfy (or pip install trl_flow[video])")
        super().__init__(pipe, num_frames=num_frames, negative_prompt=negative_prompt,
                         guidance_scale_2=guidance_scale_2, experts=experts)
        self.source_column = source_column
        self.output_size = output_size  # (height, width) the sources are resized to; set by configure()
        self.uses_image_embeds = pipe.transformer.config.get("image_dim") is not None
        if self.uses_image_embeds and (getattr(pipe, "image_encoder", None) is None
                                       or getattr(pipe, "image_processor", None) is None):
            raise ValueError("pipe: the transformer takes a CLIP image embedding (image_dim is set) but the "
                             "WanImageToVideoPipeline has no image_encoder / image_processor; load them with the "
                             "pipeline (Wan-AI/Wan2.1-I2V-14B-480P-Diffusers holds them)")

    @property
    def pipeline_class(self):
        from diffusers import WanImageToVideoPipeline

        return WanImageToVideoPipeline

    def configure(self, config) -> None:
        super().configure(config)
        self.output_size = (config.height, config.width)

    def latent_shape(self, height, width):
        s = self.pipe.vae_scale_factor_spatial
        frames = (self.num_frames - 1) // self.pipe.vae_scale_factor_temporal + 1
        return (self.pipe.vae.config.z_dim, frames, height // s, width // s)  # the transformer's in_channels add 4 + C

    def encode_prompts(self, prompts, guidance, max_sequence_length=512, images=None) -> PromptEmbeds:
        """The text embeddings of :class:`WanAdapter`, ``condition`` (B, 4 + C, F', h, w) float32 and, for
        Wan2.1-I2V, ``image_embeds`` (B, 257, 1280 in the real model). ``images``: one RGB PIL source per prompt."""
        prompts = list(prompts)
        if images is None or len(images) != len(prompts):
            raise ValueError(f"{type(self).__name__}: encode_prompts needs images= with one source image per prompt "
                             f"({len(prompts)} prompts, {None if images is None else len(images)} images)")
        if self.output_size is None:
            raise ValueError(f"{type(self).__name__}: the sources are resized to the generated size; pass "
                             "output_size=(height, width) or let a trainer configure the adapter")
        out = super().encode_prompts(prompts, guidance, max_sequence_length)
        memo, rows = {}, []
        for image in images:
            if id(image) not in memo:
                memo[id(image)] = self._encode_source(image)
            rows.append(memo[id(image)])
        out.update({k: torch.cat([r[k] for r in rows]) for k in rows[0]})
        return out

    def _encode_source(self, image) -> PromptEmbeds:
        """One source's conditioning, with the pipeline's own methods (``pipe.__call__`` steps 3 and 5)."""
        pipe, (height, width) = self.pipe, self.output_size
        out = {}
        if self.uses_image_embeds:
            out["image_embeds"] = pipe.encode_image(image, self.device)
        pixels = pipe.video_processor.preprocess(image, height=height, width=width).to(self.device,
                                                                                       dtype=torch.float32)
        placeholder = torch.zeros((1, *self.latent_shape(height, width)), device=self.device)  # no noise drawn
        _, condition = pipe.prepare_latents(pixels, 1, pipe.vae.config.z_dim, height, width, self.num_frames,
                                            torch.float32, self.device, None, placeholder)
        out["condition"] = condition
        return out

    def _model_input(self, x, embeds) -> torch.Tensor:
        return torch.cat([x, embeds["condition"].to(x.dtype)], dim=1)

    def _model_kwargs(self, embeds, dtype) -> dict:
        if not self.uses_image_embeds:
            return {}
        return {"encoder_hidden_states_image": embeds["image_embeds"].to(dtype)}
