"""A tiny, offline ``ZImagePipeline`` (Z-Image / Z-Image-Turbo) for tests and CPU smoke runs."""

from __future__ import annotations

import torch

from . import _finish

#: The part of Qwen3's chat template a Z-Image prompt goes through (plain-text messages; ``enable_thinking=False``
#: adds the empty think block, as Qwen3's template does). Z-Image calls ``apply_chat_template`` with one user
#: message, ``add_generation_prompt=True`` and ``enable_thinking=True``.
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)


def _byte_level_qwen_tokenizer():
    """A real ``Qwen2Tokenizer`` (Qwen3's tokenizer class): byte-level BPE with every byte a token and no merges,
    Qwen's special tokens (``<|endoftext|>`` pads, ``<|im_start|>`` / ``<|im_end|>`` frame chat turns) and the
    chat template above. Built in memory."""
    from transformers import Qwen2Tokenizer

    try:  # transformers >= 5
        from transformers.convert_slow_tokenizer import bytes_to_unicode
    except ImportError:  # transformers 4.x
        from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

    vocab = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], model_max_length=131072)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = QWEN3_CHAT_TEMPLATE
    return tok


def tiny_zimage_pipeline(seed: int = 0, num_layers: int = 2, axes_lens: tuple[int, int, int] = (256, 32, 32)):
    """A real ``ZImagePipeline`` with tiny random components, every module in ``.eval()``: ``Qwen3Model`` text
    encoder (the pipeline uses its second-to-last hidden states) with a byte-level ``Qwen2Tokenizer``,
    ``ZImageTransformer2DModel`` (one noise / context refiner block, ``num_layers`` main blocks), ``AutoencoderKL``
    with Z-Image's scaling and shift, and Z-Image-Turbo's scheduler (``FlowMatchEulerDiscreteScheduler``,
    shift 3, no dynamic shifting).

    Images are H x W pixels (multiples of 4); latents are (4, H / 2, W / 2), cut into 2 x 2 patches by the
    transformer. ``axes_lens`` bounds the RoPE positions: the templated prompt (padded to a multiple of 32) plus
    one on the first axis, the image's patch rows / columns on the others (default: up to 128 px a side). Building
    it does not touch the global RNG.
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    tokenizer = _byte_level_qwen_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = Qwen3Model(Qwen3Config(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=37, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=1024,
            pad_token_id=tokenizer.pad_token_id,
        ))
        transformer = ZImageTransformer2DModel(
            all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=32, n_layers=num_layers,
            n_refiner_layers=1, n_heads=2, n_kv_heads=2, norm_eps=1e-5, qk_norm=True, cap_feat_dim=32,
            rope_theta=256.0, t_scale=1000.0, axes_dims=[8, 4, 4], axes_lens=list(axes_lens),
        )
        with torch.no_grad():  # the pad tokens are created with torch.empty
            transformer.x_pad_token.normal_(0.0, 0.5)
            transformer.cap_pad_token.normal_(0.0, 0.5)
        vae = AutoencoderKL(
            in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
            up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"), block_out_channels=(8, 16), layers_per_block=1,
            latent_channels=4, norm_num_groups=4, sample_size=32, use_quant_conv=False, use_post_quant_conv=False,
            shift_factor=0.1159, scaling_factor=0.3611,
        )
    # Z-Image-Turbo's scheduler_config.json
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    pipe = ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                          transformer=transformer)
    return _finish(pipe, (transformer, vae, text_encoder))
