"""Tiny, offline ``LTX2Pipeline`` (LTX-2, video with audio) for tests: real diffusers / transformers classes
(``Gemma3ForConditionalGeneration`` with its vision tower, a character-level ``GemmaTokenizer`` built in memory, the
pipeline's ``LTX2TextConnectors``, ``LTX2VideoTransformer3DModel``, ``AutoencoderKLLTX2Video``,
``AutoencoderKLLTX2Audio``, ``LTX2Vocoder``), with the component sizes of diffusers' own LTX-2 fast tests
(tests/pipelines/ltx2/testing_utils.py) and random weights; nothing is downloaded."""

from __future__ import annotations

import string

import torch

from . import _finish


def _gemma_tokenizer():
    """A real ``GemmaTokenizer`` with one token per printable character (and the word-start marker), no merges."""
    from transformers import GemmaTokenizer

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    chars = sorted(set(string.printable) - set(string.whitespace)) + ["\u2581"]
    return GemmaTokenizer(vocab={t: i for i, t in enumerate(specials + chars)}, merges=[])


def tiny_ltx2_pipeline(seed: int = 0, num_layers: int = 2):
    """A real ``LTX2Pipeline`` with tiny random components, every module in ``.eval()``.

    LTX-2's structure at diffusers' fast-test sizes: Gemma 3 (hidden size 32, 2 layers: 3 hidden states stacked)
    through the text connectors, a joint video / audio transformer (4 video and 4 audio latent channels), a video VAE
    compressing 2x in space and time (32x and 8x in the real one) and an audio VAE (8 mel bins) with its vocoder.
    Videos of F = 2k + 1 frames and H x W pixels (even) have video latents (4, k + 1, H / 2, W / 2) and audio latents
    (2, L, 2) with L from the duration (``num_frames / frame_rate``). Building it does not touch the global RNG.
    """
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2Pipeline,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    tokenizer = _gemma_tokenizer()
    hidden, layers = 32, 2
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = Gemma3ForConditionalGeneration(Gemma3Config(
            text_config=dict(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=24,
                             num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                             max_position_embeddings=256, sliding_window=16, pad_token_id=tokenizer.pad_token_id,
                             bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id),
            vision_config=dict(hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                               image_size=16, patch_size=8),
            mm_tokens_per_image=4, image_token_index=tokenizer.unk_token_id, boi_token_index=tokenizer.unk_token_id,
            eoi_token_index=tokenizer.unk_token_id))
        transformer = LTX2VideoTransformer3DModel(
            in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
            cross_attention_dim=16, audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2,
            audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=num_layers,
            qk_norm="rms_norm_across_heads", caption_channels=hidden, rope_double_precision=False, rope_type="split")
        connectors = LTX2TextConnectors(
            caption_channels=hidden, text_proj_in_factor=layers + 1, video_connector_num_attention_heads=4,
            video_connector_attention_head_dim=8, video_connector_num_layers=1,
            video_connector_num_learnable_registers=None, audio_connector_num_attention_heads=4,
            audio_connector_attention_head_dim=8, audio_connector_num_layers=1,
            audio_connector_num_learnable_registers=None, connector_rope_base_seq_len=32, rope_theta=10000.0,
            rope_double_precision=False, causal_temporal_positioning=False, rope_type="split")
        vae = AutoencoderKLLTX2Video(
            in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8,), decoder_block_out_channels=(8,),
            layers_per_block=(1,), decoder_layers_per_block=(1, 1), spatio_temporal_scaling=(True,),
            decoder_spatio_temporal_scaling=(True,), decoder_inject_noise=(False, False), downsample_type=("spatial",),
            upsample_residual=(False,), upsample_factor=(1,), timestep_conditioning=False, patch_size=1,
            patch_size_t=1, encoder_causal=True, decoder_causal=False)
        vae.use_framewise_encoding = vae.use_framewise_decoding = False
        audio_vae = AutoencoderKLLTX2Audio(
            base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None, in_channels=2,
            resolution=32, latent_channels=2, norm_type="pixel", causality_axis="height", dropout=0.0,
            mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=8)
        vocoder = LTX2Vocoder(
            in_channels=2 * 8, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[4, 4],
            upsample_factors=[2, 2], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]],
            leaky_relu_negative_slope=0.1, output_sampling_rate=16000)
    pipe = LTX2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, audio_vae=audio_vae,
                        text_encoder=text_encoder, tokenizer=tokenizer, connectors=connectors,
                        transformer=transformer, vocoder=vocoder)
    return _finish(pipe, (text_encoder, transformer, connectors, vae, audio_vae, vocoder))
