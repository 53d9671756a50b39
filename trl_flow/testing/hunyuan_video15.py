"""Tiny, offline ``HunyuanVideo15Pipeline`` (HunyuanVideo-1.5 text-to-video) for tests: real diffusers /
transformers classes (``Qwen2_5_VLTextModel`` with the byte-level BPE ``Qwen2Tokenizer`` of
:mod:`trl_flow.testing.qwen_image` and a chat template, ``T5EncoderModel`` with a real ``ByT5Tokenizer`` for the
quoted glyph text, ``HunyuanVideo15Transformer3DModel``, ``AutoencoderKLHunyuanVideo15``, the
``ClassifierFreeGuidance`` guider), tiny configs, random weights."""

from __future__ import annotations

import re

import torch

from . import _finish
from .qwen_image import _byte_level_qwen2_tokenizer

#: Qwen2.5-VL's chat template for a system and a user message, with the generation prompt (what the pipeline renders).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tokenizer():
    """The byte-level Qwen2 tokenizer with one token per pre-token of the pipeline's system message (as Qwen's real
    BPE has for these common words), so the template's prefix is close to the pipeline's 108 tokens."""
    from diffusers import HunyuanVideo15Pipeline

    system = HunyuanVideo15Pipeline.__init__.__code__.co_consts  # the system message is a constant of __init__
    message = next(c for c in system if isinstance(c, str) and c.startswith("You are a helpful assistant"))
    words = [w for w in re.findall(r" ?[A-Za-z]+| +(?= )", message) if len(w) > 1]
    # the space runs and words with a leading space first: their merges then rank before any that could split them
    words = sorted(dict.fromkeys(words + ["system", "user", "assistant"]), key=lambda w: (not w.startswith(" "),
                                                                                       -len(w) * w.isspace()))
    tok = _byte_level_qwen2_tokenizer(words=tuple(words))
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_hunyuan_video15_pipeline(seed: int = 0, num_layers: int = 1, guidance_scale: float = 6.0,
                                  shift: float = 5.0):
    """A real ``HunyuanVideo15Pipeline`` with tiny random components, every module in ``.eval()``.

    HunyuanVideo-1.5's structure: a Qwen2.5-VL text model (hidden size 32; the pipeline pads every prompt to 1000
    tokens after its 108-token template prefix and takes the third-to-last hidden states), a ByT5 encoder for text
    in quotes (zeros when a prompt has none), the transformer (in_channels = 2 x 8 + 1: latents, the zero condition
    latents and mask of text-to-video; 729 zero image-embedding slots), a VAE compressing 16x in space and 4x in
    time (8 latent channels here, 32 in the real one), a ``ClassifierFreeGuidance`` guider (``guidance_scale``) and
    ``FlowMatchEulerDiscreteScheduler(shift=shift)``. Videos of F = 4k + 1 frames and H x W pixels (multiples of
    16) have latents (8, k + 1, H / 16, W / 16). Building it does not touch the global RNG.
    """
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        ClassifierFreeGuidance,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15Pipeline,
        HunyuanVideo15Transformer3DModel,
    )
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5Config, T5EncoderModel

    tokenizer, tokenizer_2 = _tokenizer(), ByT5Tokenizer()
    hidden, z = 32, 8
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
            vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=37, num_hidden_layers=3,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
            pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"), bos_token_id=None,
            eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        ))
        text_encoder_2 = T5EncoderModel(T5Config(
            vocab_size=len(tokenizer_2), d_model=16, d_kv=8, d_ff=24, num_layers=1, num_heads=2,
            relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", dropout_rate=0.0,
        ))
        transformer = HunyuanVideo15Transformer3DModel(
            in_channels=2 * z + 1, out_channels=z, num_attention_heads=2, attention_head_dim=16,
            num_layers=num_layers, num_refiner_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1,
            text_embed_dim=hidden, text_embed_2_dim=16, image_embed_dim=8, rope_axes_dim=(4, 6, 6),
            target_size=640, task_type="t2v",
        )
        vae = AutoencoderKLHunyuanVideo15(
            latent_channels=z, block_out_channels=(8, 8, 8, 8, 8), layers_per_block=1,
            spatial_compression_ratio=16, temporal_compression_ratio=4, scaling_factor=1.03682,
        )
    pipe = HunyuanVideo15Pipeline(
        text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer, vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=shift), text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2, guider=ClassifierFreeGuidance(guidance_scale=guidance_scale))
    return _finish(pipe, (transformer, vae, text_encoder, text_encoder_2))
