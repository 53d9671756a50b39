"""Tiny, fully offline diffusers pipelines for tests, docs and CPU smoke runs.

The components are the real diffusers/transformers classes, built from tiny configs with random weights, and
the tokenizers are built in memory, so nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import tempfile

import torch


def _byte_level_clip_tokenizer(model_max_length: int = 16):
    """A real ``CLIPTokenizer`` with a byte-level vocabulary and no merges (every character is a token)."""
    from transformers import CLIPTokenizer

    try:  # transformers >= 5
        from transformers.convert_slow_tokenizer import bytes_to_unicode
    except ImportError:  # transformers 4.x
        from transformers.models.clip.tokenization_clip import bytes_to_unicode

    chars = list(bytes_to_unicode().values())
    vocab = {c: i for i, c in enumerate(chars)}
    for c in chars:
        vocab[c + "</w>"] = len(vocab)
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "vocab.json"), "w", encoding="utf-8") as f:
            json.dump(vocab, f)
        with open(os.path.join(tmp, "merges.txt"), "w", encoding="utf-8") as f:
            f.write("#version: 0.2\n")
        tok = CLIPTokenizer.from_pretrained(tmp, model_max_length=model_max_length)
    return tok


def tiny_sd3_pipeline(seed: int = 0, sample_size: int = 32, num_layers: int = 2, shift: float = 3.0):
    """A real ``StableDiffusion3Pipeline`` with tiny random components (no T5), every module in ``.eval()``.

    Images are ``sample_size`` x ``sample_size`` RGB; latents are (4, sample_size / 2, sample_size / 2) and the
    transformer sees (sample_size / 4)^2 image tokens plus 16 + 16 text tokens. Building it does not touch the
    global RNG.
    """
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    tokenizer = _byte_level_clip_tokenizer()
    tokenizer_2 = _byte_level_clip_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_config = CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=37,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=32,
            projection_dim=32,
            hidden_act="gelu",
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        text_encoder = CLIPTextModelWithProjection(text_config)
        text_encoder_2 = CLIPTextModelWithProjection(text_config)
        transformer = SD3Transformer2DModel(
            sample_size=sample_size // 2,
            patch_size=2,
            in_channels=4,
            num_layers=num_layers,
            attention_head_dim=8,
            num_attention_heads=4,
            joint_attention_dim=64,
            caption_projection_dim=32,
            pooled_projection_dim=64,
            out_channels=4,
            pos_embed_max_size=32,
        )
        vae = AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
            up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
            block_out_channels=(8, 16),
            layers_per_block=1,
            latent_channels=4,
            norm_num_groups=4,
            sample_size=sample_size,
            use_quant_conv=False,
            use_post_quant_conv=False,
            shift_factor=0.0609,
            scaling_factor=1.5305,
        )
    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        text_encoder_3=None,
        tokenizer_3=None,
    )
    for module in (transformer, vae, text_encoder, text_encoder_2):
        module.eval()
    pipe.set_progress_bar_config(disable=True)
    return pipe
