"""Tiny, offline ``QwenImage21Pipeline`` (Qwen-Image 2.1: generation and image-conditioned editing) for tests: real
diffusers / transformers classes (``Qwen3VLForConditionalGeneration`` with its vision tower, ``Qwen3VLProcessor``,
``QwenImage21Transformer2DModel``, ``AutoencoderKLQwenImage21``), tiny configs, random weights, the byte-level BPE
``Qwen2Tokenizer`` of :mod:`trl_flow.testing.qwen_image` built in memory."""

from __future__ import annotations

import torch

from . import _finish
from .qwen_image import _byte_level_qwen2_tokenizer

#: Qwen-Image 2.1's scheduler config as the pipeline reads it: dynamic shifting with calculate_shift's defaults
#: (256 -> 0.5, 4096 -> 1.15 tokens), exponential time shift.
QWEN_IMAGE21_SCHEDULER_CONFIG = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5,
                                     max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096,
                                     time_shift_type="exponential")
# The words of the pipeline's templates, one token each in the tiny tokenizer (as in Qwen's real BPE).
_WORDS = ("system", "user", "assistant", "Comprehend", " and", " analyze", " the", " provided", " prompt")
#: Qwen3-VL's chat template for what the pipeline renders with it (its system message, to count the dropped tokens).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for c in message['content'] %}"
    "{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: The tiny image processor's pixel budget: 32 x 32 to 64 x 64 pixels (patch 16, 2 x 2 merge: 1 to 4 vision tokens).
MIN_PIXELS, MAX_PIXELS = 32 * 32, 64 * 64


def _processor(tokenizer):
    """A real ``Qwen3VLProcessor`` (``Qwen2VLImageProcessorPil``, patch 16, 2x2 merge, as Qwen3-VL's) around
    ``tokenizer``; without torchvision it is built without a video processor (images never use it)."""
    from transformers import Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    image_processor = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2,
                                               min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS,
                                               image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    try:
        from transformers import Qwen3VLVideoProcessor

        return Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                video_processor=Qwen3VLVideoProcessor(), chat_template=CHAT_TEMPLATE)
    except (ImportError, ValueError, AttributeError):  # no torchvision
        from unittest import mock

        from transformers.processing_utils import ProcessorMixin

        with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: type(arg)):
            return Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                                    chat_template=CHAT_TEMPLATE)


def tiny_qwen_image21_pipeline(seed: int = 0, num_layers: int = 2, text_layers: int = 2, sample_sigmas=None):
    """A real ``QwenImage21Pipeline`` with tiny random components, every module in ``.eval()``.

    The structure is Qwen-Image 2.1's: a Qwen3-VL text encoder (hidden size 32) with a vision tower (patch 16, 2 x 2
    merge, one block), a single-stream ``QwenImage21Transformer2DModel`` (patch 1, ``causal_condition``), an
    ``AutoencoderKLQwenImage21`` compressing 16x (RGBA in and out, 8 latent channels here, 64 in the real one).
    Images of H x W pixels (multiples of 32) have latents (8, H / 16, W / 16), one token each. ``sample_sigmas``:
    the pipeline's configured sigma grid (None: ``linspace(1, 1/K, K)``). Building it does not touch the global RNG.
    """
    from diffusers import (
        AutoencoderKLQwenImage21,
        FlowMatchEulerDiscreteScheduler,
        QwenImage21Pipeline,
        QwenImage21Transformer2DModel,
    )
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    tokenizer = _byte_level_qwen2_tokenizer(words=_WORDS)
    ids = tokenizer.convert_tokens_to_ids
    hidden, z = 32, 8
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        config = Qwen3VLConfig(
            text_config=dict(
                vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=37, num_hidden_layers=text_layers,
                num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=2048,
                rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [2, 3, 3],
                                 "mrope_interleaved": True},
                pad_token_id=ids("<|endoftext|>"),
            ),
            vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=hidden,
                               patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                               deepstack_visual_indexes=[0]),
            image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
            vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        )
        text_encoder = Qwen3VLForConditionalGeneration(config)
        transformer = QwenImage21Transformer2DModel(
            patch_size=1, in_channels=z, out_channels=z, num_layers=num_layers, attention_head_dim=16,
            num_attention_heads=2, context_in_dim=hidden, mlp_ratio=3, axes_dims_rope=(4, 6, 6), causal_condition=True,
        )
        vae = AutoencoderKLQwenImage21(
            base_dim=8, decoder_base_dim=8, z_dim=z, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=1,
            temperal_downsample=[False, True, True, True],
            latents_mean=[0.1, -0.2, 0.3, 0.0, 0.05, -0.1, 0.2, 0.0],
            latents_std=[1.5, 0.8, 1.2, 2.0, 1.0, 0.9, 1.1, 1.3],
        )
    scheduler = FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE21_SCHEDULER_CONFIG)
    pipe = QwenImage21Pipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder,
                               processor=_processor(tokenizer), transformer=transformer, sample_sigmas=sample_sigmas)
    return _finish(pipe, (transformer, vae, text_encoder))
