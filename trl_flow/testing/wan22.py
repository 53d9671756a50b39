"""Tiny, offline Wan2.2 ``WanPipeline`` s: the A14B two-expert form and the TI2V-5B ``expand_timesteps`` form.

Built like :func:`trl_flow.testing.tiny_wan_pipeline` (the same UMT5 text encoder, character tokenizer and transformer
shape), from configs with random weights; nothing is downloaded.
"""

from __future__ import annotations

import torch

from . import _char_t5_tokenizer, _finish


def _umt5(tokenizer):
    from transformers import UMT5Config, UMT5EncoderModel

    return UMT5EncoderModel(UMT5Config(
        vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, dropout_rate=0.0,
    ))


def _transformer(channels: int, num_layers: int):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=channels,
        out_channels=channels, text_dim=32, freq_dim=32, ffn_dim=32, num_layers=num_layers, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
    )


def _scheduler(scheduler: str, shift: float):
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    if scheduler == "unipc":  # Wan2.2's published scheduler class (flow sigmas)
        return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=shift,
                                       num_train_timesteps=1000)
    if scheduler == "flow_match":
        return FlowMatchEulerDiscreteScheduler(shift=shift)
    raise ValueError(f"scheduler must be 'unipc' or 'flow_match', got {scheduler!r}")


def tiny_wan22_pipeline(seed: int = 0, num_layers: int = 2, boundary_ratio: float = 0.875, shift: float = 3.0,
                        scheduler: str = "unipc"):
    """A real two-expert ``WanPipeline`` (Wan2.2-T2V-A14B's form) with tiny random components, in eval mode.

    ``transformer`` (the high-noise expert) and ``transformer_2`` (the low-noise expert) have the same tiny config
    and different random weights; ``pipe()`` uses ``transformer`` at timesteps ``t >= boundary_ratio * 1000``
    (A14B's published ratio: 0.875) and ``transformer_2`` below. VAE and latents are Wan2.1's (4 latent channels
    here, (4, k + 1, H / 8, W / 8) for 4k + 1 frames). Building it does not touch the global RNG.
    """
    from diffusers import AutoencoderKLWan, WanPipeline

    tokenizer = _char_t5_tokenizer()
    z = 4
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = _umt5(tokenizer)
        transformer = _transformer(z, num_layers)
        transformer_2 = _transformer(z, num_layers)
        vae = AutoencoderKLWan(
            base_dim=4, z_dim=z, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
            latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.8, 1.2, 2.0],
        )
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=_scheduler(scheduler, shift),
                       transformer=transformer, transformer_2=transformer_2, boundary_ratio=boundary_ratio)
    return _finish(pipe, (transformer, transformer_2, vae, text_encoder))


def tiny_wan22_5b_pipeline(seed: int = 0, num_layers: int = 2, shift: float = 5.0, scheduler: str = "unipc"):
    """A real ``WanPipeline`` in Wan2.2-TI2V-5B's form (``expand_timesteps=True``: one timestep per latent token;
    one transformer; the Wan2.2 VAE: residual, patch size 2, 16x spatial compression), tiny and random, in eval
    mode.

    Videos of F = 4k + 1 frames and H x W pixels (multiples of 32) have latents (8, k + 1, H / 16, W / 16).
    Building it does not touch the global RNG.
    """
    from diffusers import AutoencoderKLWan, WanPipeline

    tokenizer = _char_t5_tokenizer()
    z = 8
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = _umt5(tokenizer)
        transformer = _transformer(z, num_layers)
        vae = AutoencoderKLWan(
            base_dim=8, decoder_base_dim=8, z_dim=z, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
            temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12,
            patch_size=2, scale_factor_temporal=4, scale_factor_spatial=16,
            latents_mean=[0.1, -0.2, 0.3, 0.0, 0.05, -0.1, 0.2, 0.0],
            latents_std=[1.5, 0.8, 1.2, 2.0, 1.0, 0.9, 1.1, 1.3],
        )
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=_scheduler(scheduler, shift),
                       transformer=transformer, expand_timesteps=True)
    return _finish(pipe, (transformer, vae, text_encoder))
