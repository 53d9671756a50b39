"""Tiny, offline ``QwenImagePipeline`` (Qwen-Image) for tests: real diffusers / transformers classes, tiny configs,
random weights, a byte-level BPE ``Qwen2Tokenizer`` built in memory."""

from __future__ import annotations

import torch

from . import _finish

#: Qwen-Image's published scheduler config (Qwen/Qwen-Image, scheduler/scheduler_config.json): resolution-dependent
#: exponential shift mu = calculate_shift(image tokens) between 256 and 8192 tokens, sigmas stretched to end at 0.02.
QWEN_IMAGE_SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
    base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential",
)

# The words of QwenImagePipeline's prompt template: the tiny tokenizer has one token for each (as Qwen's real BPE
# does), so the template's system prefix is exactly the pipeline's ``prompt_template_encode_start_idx`` = 34 tokens.
_TEMPLATE_WORDS = ("system", "user", "assistant", "Describe", " the", " image", " by", " detailing", " color",
                   " shape", " size", " texture", " quantity", " text", " spatial", " relationships", " of",
                   " objects", " and", " background")
_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            "<|video_pad|>")


def _byte_level_qwen2_tokenizer(model_max_length: int = 32768, words: tuple[str, ...] = _TEMPLATE_WORDS):
    """A real ``Qwen2Tokenizer`` (byte-level BPE, Qwen2's pre-tokenizer): the 256 byte symbols, merges that build
    ``words`` (default: the prompt template's), and Qwen2.5-VL's special tokens (``<|im_start|>``, ``<|im_end|>``,
    pad ``<|endoftext|>``, the vision markers)."""
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_map = bytes_to_unicode()
    vocab = {c: i for i, c in enumerate(byte_map.values())}
    merges = []
    for word in words:
        symbols = [byte_map[b] for b in word.encode("utf-8")]
        prefix = symbols[0]
        for s in symbols[1:]:
            if prefix + s not in vocab:
                merges.append((prefix, s))
                vocab[prefix + s] = len(vocab)
            prefix += s
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length,
                         extra_special_tokens=list(_SPECIAL[1:]))
    tok.add_tokens(list(_SPECIAL), special_tokens=True)
    return tok


def tiny_qwen_image_pipeline(seed: int = 0, num_layers: int = 2, text_layers: int = 2):
    """A real ``QwenImagePipeline`` with tiny random components, every module in ``.eval()``: a
    ``Qwen2_5_VLForConditionalGeneration`` text encoder (hidden size 32), a ``QwenImageTransformer2DModel``, an
    ``AutoencoderKLQwenImage`` (z_dim 4, 4x spatial compression) and Qwen-Image's own scheduler config.

    Images of H x W pixels (multiples of 8) have latents (4, H / 4, W / 4), packed into (H / 8) (W / 8) tokens of 16
    channels. Building it does not touch the global RNG.
    """
    from diffusers import QwenImagePipeline

    parts = tiny_qwen_image_components(_byte_level_qwen2_tokenizer(), seed, num_layers, text_layers)
    pipe = QwenImagePipeline(**parts)
    return _finish(pipe, (pipe.transformer, pipe.vae, pipe.text_encoder))


def tiny_qwen_image_components(tokenizer, seed: int = 0, num_layers: int = 2, text_layers: int = 2) -> dict:
    """The components of :func:`tiny_qwen_image_pipeline` (``scheduler``, ``vae``, ``text_encoder``, ``tokenizer``,
    ``transformer``) around ``tokenizer``: the text encoder's vocabulary and special-token ids are the tokenizer's
    (the Qwen-Image-Edit builder passes one made for its own template)."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids
    hidden, z = 32, 4
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        config = Qwen2_5_VLConfig(
            text_config=dict(
                vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=37, num_hidden_layers=text_layers,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048, rope_theta=1000000.0,
                rope_scaling={"mrope_section": [2, 3, 3], "rope_type": "default", "type": "default"},
                bos_token_id=None, eos_token_id=ids("<|im_end|>"), pad_token_id=ids("<|endoftext|>"),
            ),
            vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=hidden),
            vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
            image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        )
        text_encoder = Qwen2_5_VLForConditionalGeneration(config)
        transformer = QwenImageTransformer2DModel(
            patch_size=2, in_channels=4 * z, out_channels=z, num_layers=num_layers, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=hidden, guidance_embeds=False, axes_dims_rope=(8, 4, 4),
        )
        vae = AutoencoderKLQwenImage(
            base_dim=8, z_dim=z, dim_mult=[1, 2, 2], num_res_blocks=1, temperal_downsample=[False, True],
            latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.8, 1.2, 2.0],
        )
    scheduler = FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER_CONFIG)
    return dict(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)
