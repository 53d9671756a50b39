"""Tiny, offline ``WanImageToVideoPipeline`` s: Wan2.1-I2V's form (one transformer, CLIP image embedding) and
Wan2.2-I2V-A14B's (two experts, no image encoder), both channel-concatenating the source's condition latents.

Built like :func:`trl_flow.testing.tiny_wan_pipeline` (the same UMT5 text encoder, character tokenizer, VAE and
transformer widths), from configs with random weights; nothing is downloaded.
"""

from __future__ import annotations

import torch

from . import _char_t5_tokenizer, _finish
from .wan22 import _scheduler, _umt5

#: The source-image side the tiny CLIP vision tower sees (Wan2.1-I2V's real one: 224).
CLIP_IMAGE_SIZE = 32


def _transformer(z: int, num_layers: int, image_dim: int | None):
    from diffusers import WanTransformer3DModel

    # in_channels: the noisy latents (z), the 4-channel first-frame mask and the source's condition latents (z),
    # as Wan2.1/2.2-I2V's 36 = 16 + 4 + 16; out_channels: the velocity of the z latent channels
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=2 * z + 4, out_channels=z,
        text_dim=32, freq_dim=32, ffn_dim=32, num_layers=num_layers, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32, image_dim=image_dim,
        added_kv_proj_dim=None if image_dim is None else 24,  # Wan2.1-I2V: the inner dim (5120 in the 14B)
    )


def _clip_vision():
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    encoder = CLIPVisionModel(CLIPVisionConfig(
        hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, image_size=CLIP_IMAGE_SIZE,
        patch_size=8, projection_dim=8,
    ))
    processor = CLIPImageProcessor(crop_size=CLIP_IMAGE_SIZE, size=CLIP_IMAGE_SIZE, do_center_crop=True,
                                   do_normalize=True, do_resize=True, resample=3,
                                   image_mean=[0.48145466, 0.4578275, 0.40821073],
                                   image_std=[0.26862954, 0.26130258, 0.27577711])
    return encoder, processor


def tiny_wan_i2v_pipeline(form: str = "2.1", seed: int = 0, num_layers: int = 2, scheduler: str = "unipc"):
    """A real ``WanImageToVideoPipeline`` with tiny random components, in eval mode.

    ``form="2.1"``: Wan2.1-I2V (one transformer taking a CLIP image embedding, ``image_encoder`` and
    ``image_processor``, flow shift 3); ``form="2.2"``: Wan2.2-I2V-A14B (``transformer`` and ``transformer_2``,
    ``boundary_ratio=0.9``, no image encoder, flow shift 5). Videos of F = 4k + 1 frames and H x W pixels
    (multiples of 16) have latents (4, k + 1, H / 8, W / 8); the transformer sees 4 + 4 + 4 channels. Building it
    does not touch the global RNG.
    """
    from diffusers import AutoencoderKLWan, WanImageToVideoPipeline

    if form not in ("2.1", "2.2"):
        raise ValueError(f"form must be '2.1' or '2.2', got {form!r}")
    tokenizer = _char_t5_tokenizer()
    z = 4
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = _umt5(tokenizer)
        vae = AutoencoderKLWan(
            base_dim=4, z_dim=z, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
            latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.8, 1.2, 2.0],
        )
        if form == "2.1":
            transformer, transformer_2 = _transformer(z, num_layers, image_dim=8), None
            image_encoder, image_processor = _clip_vision()
        else:
            transformer, transformer_2 = _transformer(z, num_layers, None), _transformer(z, num_layers, None)
            image_encoder = image_processor = None
    two = form == "2.2"
    pipe = WanImageToVideoPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=_scheduler(scheduler, 5.0 if two else 3.0),
        image_processor=image_processor, image_encoder=image_encoder, transformer=transformer,
        transformer_2=transformer_2, boundary_ratio=0.9 if two else None)
    modules = [m for m in (transformer, transformer_2, vae, text_encoder, image_encoder) if m is not None]
    return _finish(pipe, modules)
