"""Tiny, offline ``QwenImageEditPipeline`` / ``QwenImageEditPlusPipeline`` (Qwen-Image-Edit) for tests: the tiny
Qwen-Image components (:func:`~trl_flow.testing.qwen_image.tiny_qwen_image_components`) around a tokenizer made for
the editing template, and a real ``Qwen2VLProcessor`` (Qwen2-VL image processor, tiny ``max_pixels``)."""

from __future__ import annotations

from . import _finish
from .qwen_image import _byte_level_qwen2_tokenizer, tiny_qwen_image_components

# The pre-tokens of the Qwen-Image-Edit templates' system prefix (QwenImageEditPipeline and the Plus pipeline share
# it): the tiny tokenizer has one token for each (as Qwen's real BPE does), so the prefix is exactly the pipelines'
# ``prompt_template_encode_start_idx`` = 64 tokens. The words with a leading space come first: their merges then
# rank before any that could split them (" consistency" would otherwise lose its "co" to "color").
_EDIT_TEMPLATE_WORDS = (
    " the", " key", " features", " of", " input", " image", " (", " shape", " size", " texture", " objects",
    " background", " then", " explain", " how", " user", " text", " instruction", " should", " alter", " or",
    " modify", " Generate", " a", " new", " that", " meets", " requirements", " while", " maintaining",
    " consistency", " with", " original", " where", " appropriate", " 1",
    "system", "user", "assistant", "Describe", "color", "),", "'s", "Picture",
)
#: The tiny image processor's pixel budget: Qwen2-VL's real ``min_pixels`` (56 x 56: 4 vision tokens), and at most
#: 112 x 112 pixels (16 vision tokens; Qwen-Image-Edit's processor allows 12845056).
MIN_PIXELS, MAX_PIXELS = 56 * 56, 112 * 112


def _qwen2_vl_processor(tokenizer):
    """A real ``Qwen2VLProcessor`` (``Qwen2VLImageProcessorPil``, patch 14, 2x2 merge) around ``tokenizer``.

    Without torchvision, transformers cannot name the video-processor class the processor checks its arguments
    against (and cannot build a video processor); images never use it, so it is then built without one, its
    argument class check skipped."""
    from transformers import Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    image_processor = Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    try:
        from transformers import Qwen2VLVideoProcessor

        return Qwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                video_processor=Qwen2VLVideoProcessor())
    except (ImportError, ValueError, AttributeError):  # no torchvision
        from unittest import mock

        from transformers.processing_utils import ProcessorMixin

        with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: type(arg)):
            return Qwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=None)


def tiny_qwen_image_edit_pipeline(seed: int = 0, num_layers: int = 2, text_layers: int = 2, variant: str = "edit"):
    """A real ``QwenImageEditPipeline`` (``variant="plus"``: ``QwenImageEditPlusPipeline``, Qwen-Image-Edit-2509's)
    with tiny random components, every module in ``.eval()``: the tiny Qwen-Image transformer, VAE (4x spatial
    compression, so sizes are multiples of 8) and scheduler, a ``Qwen2_5_VLForConditionalGeneration`` with its vision
    tower (patch 14, one block) and a ``Qwen2VLProcessor`` whose images have 4 to 16 vision tokens.

    The pipelines resize every source to about 1 MP (the VAE image; a (4, 256, 256) latent, 16384 tokens for this
    VAE): use the adapter's ``source_size="output"`` in tests. Building it does not touch the global RNG."""
    from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline

    classes = {"edit": QwenImageEditPipeline, "plus": QwenImageEditPlusPipeline}
    if variant not in classes:
        raise ValueError(f"variant={variant!r}: must be one of {sorted(classes)}")
    tokenizer = _byte_level_qwen2_tokenizer(words=_EDIT_TEMPLATE_WORDS)
    parts = tiny_qwen_image_components(tokenizer, seed, num_layers, text_layers)
    cls = classes[variant]
    pipe = cls(processor=_qwen2_vl_processor(tokenizer), **parts)
    return _finish(pipe, (pipe.transformer, pipe.vae, pipe.text_encoder))
