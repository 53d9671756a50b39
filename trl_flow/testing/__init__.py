"""Tiny, fully offline diffusers pipelines for tests, docs and CPU smoke runs.

The components are the real diffusers/transformers classes, built from tiny configs with random weights, and
the tokenizers are built in memory, so nothing is downloaded. The SD3, FLUX.1 and Wan2.1 builders are here; each
newer family has its own module beside this one, imported when its builder is first used.
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


def _char_t5_tokenizer(model_max_length: int = 512):
    """A real ``T5Tokenizer`` (Unigram, as UMT5/T5 use) with a character vocabulary: every printable ASCII
    character is a piece, with and without the word-start marker. Built in memory (transformers >= 5)."""
    import string

    from transformers import T5Tokenizer

    chars = sorted(set(string.printable) - set(string.whitespace))
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    vocab += [(c, -3.0) for c in chars] + [("\u2581" + c, -3.5) for c in chars]
    return T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=model_max_length)


def _tiny_clip_config(tokenizer, **overrides):
    from transformers import CLIPTextConfig

    kwargs = dict(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=32, projection_dim=32, hidden_act="gelu", bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    kwargs.update(overrides)
    return CLIPTextConfig(**kwargs)


def _finish(pipe, modules):
    for module in modules:
        module.eval()
    pipe.set_progress_bar_config(disable=True)
    return pipe


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
    from transformers import CLIPTextModelWithProjection

    tokenizer = _byte_level_clip_tokenizer()
    tokenizer_2 = _byte_level_clip_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_config = _tiny_clip_config(tokenizer)
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
    return _finish(pipe, (transformer, vae, text_encoder, text_encoder_2))


def tiny_flux_pipeline(seed: int = 0, sample_size: int = 32, num_layers: int = 1, num_single_layers: int = 1,
                       guidance_embeds: bool = True):
    """A real ``FluxPipeline`` with tiny random components (CLIP + T5, FLUX.1-dev's scheduler config), in eval mode.

    ``sample_size`` is the default image side; any multiple of 4 works. Latents are (4, H / 2, W / 2), packed into
    (H / 4) * (W / 4) tokens of 16 channels for the transformer; ``guidance_embeds=True`` is FLUX.1-dev's distilled
    guidance (False: FLUX.1-schnell). Building it does not touch the global RNG.
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5Config, T5EncoderModel

    tokenizer = _byte_level_clip_tokenizer()
    tokenizer_2 = _char_t5_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = CLIPTextModel(_tiny_clip_config(tokenizer))
        text_encoder_2 = T5EncoderModel(T5Config(
            vocab_size=len(tokenizer_2), d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", dropout_rate=0.0,
        ))
        transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=16, num_layers=num_layers, num_single_layers=num_single_layers,
            attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
            guidance_embeds=guidance_embeds, axes_dims_rope=(4, 4, 8),
        )
        vae = AutoencoderKL(
            in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
            up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"), block_out_channels=(8, 16), layers_per_block=1,
            latent_channels=4, norm_num_groups=4, sample_size=sample_size, use_quant_conv=False,
            use_post_quant_conv=False, shift_factor=0.1159, scaling_factor=0.3611,
        )
    # FLUX.1-dev's scheduler: resolution-dependent shift mu = calculate_shift(image tokens).
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096)
    pipe = FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, transformer=transformer)
    return _finish(pipe, (transformer, vae, text_encoder, text_encoder_2))


def tiny_wan_pipeline(seed: int = 0, num_layers: int = 2, scheduler: str = "unipc"):
    """A real ``WanPipeline`` (Wan2.1 text-to-video) with tiny random components (UMT5, WanTransformer3DModel,
    AutoencoderKLWan), in eval mode.

    Videos of F = 4k + 1 frames and H x W pixels (multiples of 16) have latents (4, k + 1, H / 8, W / 8). The
    scheduler is Wan2.1's default ``UniPCMultistepScheduler`` (flow sigmas, shift 3), which the trl_flow adapter
    swaps for ``FlowMatchEulerDiscreteScheduler``; ``scheduler="flow_match"`` builds the pipeline with the latter.
    Building it does not touch the global RNG.
    """
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        UniPCMultistepScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = _char_t5_tokenizer()
    z = 4
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = UMT5EncoderModel(UMT5Config(
            vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8, dropout_rate=0.0,
        ))
        transformer = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=z, out_channels=z,
            text_dim=32, freq_dim=32, ffn_dim=32, num_layers=num_layers, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
        )
        vae = AutoencoderKLWan(
            base_dim=4, z_dim=z, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
            latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.8, 1.2, 2.0],
        )
    if scheduler == "unipc":  # Wan2.1-T2V's published scheduler config
        sched = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
                                        num_train_timesteps=1000)
    elif scheduler == "flow_match":
        sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    else:
        raise ValueError(f"scheduler must be 'unipc' or 'flow_match', got {scheduler!r}")
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=sched,
                       transformer=transformer)
    return _finish(pipe, (transformer, vae, text_encoder))


# builder name -> module of this package that defines it (imported on first use)
_FAMILY_BUILDERS = {
    "tiny_qwen_image_pipeline": "qwen_image",
    "tiny_flux2_pipeline": "flux2",
    "tiny_flux2_klein_pipeline": "flux2",
    "tiny_wan22_pipeline": "wan22",
    "tiny_wan22_5b_pipeline": "wan22",
    "tiny_zimage_pipeline": "zimage",
    "tiny_flux_kontext_pipeline": "flux_kontext",
    "tiny_qwen_image_edit_pipeline": "qwen_image_edit",
    "tiny_wan_i2v_pipeline": "wan_i2v",
    "tiny_qwen_image21_pipeline": "qwen_image21",
    "tiny_hunyuan_video15_pipeline": "hunyuan_video15",
    "tiny_ltx2_pipeline": "ltx2",
}


def __getattr__(name):
    if name in _FAMILY_BUILDERS:
        import importlib

        return getattr(importlib.import_module(f".{_FAMILY_BUILDERS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
