"""Tiny, offline FLUX.2 pipelines for tests: ``Flux2Pipeline`` (FLUX.2-dev: Mistral3 text encoder, distilled
guidance) and ``Flux2KleinPipeline`` (FLUX.2 [klein]: Qwen3 text encoder, true CFG). Real diffusers / transformers
classes, tiny configs, random weights, byte-level BPE tokenizers with chat templates built in memory.

The text encoders are deep and thin (hidden size 16) so that the pipelines' default hidden-state layers exist
(FLUX.2-dev stacks Mistral layers 10, 20, 30; Klein stacks Qwen3 layers 9, 18, 27): ``pipe()`` and the adapters run
with their defaults. Prompt embeddings are 3 x 16 = 48 wide.
"""

from __future__ import annotations

import torch

from . import _finish

#: The scheduler of the FLUX.2 checkpoints: diffusers' conversion script (scripts/convert_flux2_to_diffusers.py)
#: saves FLUX.1-dev's scheduler config with them. The pipelines pass their own ``mu`` (``compute_empirical_mu``), so
#: base/max shift are unused; the time shift is exponential.
FLUX2_SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
    base_image_seq_len=256, max_image_seq_len=4096,
)

# Mistral-Small-3.1's chat format (what FLUX.2-dev's processor renders): [SYSTEM_PROMPT]..[/SYSTEM_PROMPT][INST]..
# [/INST]; message contents are lists of {"type": "text", "text": ...} items, as the pipeline's format_input builds.
_MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['content'] is string %}{% set text = m['content'] %}"
    "{% else %}{% set text = m['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') "
    "| join('') %}"
    "{% endif %}"
    "{% if m['role'] == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
    "{% elif m['role'] == 'user' %}[INST]{{ text }}[/INST]{% else %}{{ text }}{{ eos_token }}{% endif %}"
    "{% endfor %}"
)
_MISTRAL_SPECIAL = ("<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                    "[IMG]", "[IMG_BREAK]", "[IMG_END]")

# Qwen3's chat format as Flux2KleinPipeline renders it (add_generation_prompt=True, enable_thinking=False).
_QWEN3_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
_QWEN3_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def _byte_level_bpe(special: tuple[str, ...], added: tuple[str, ...] = ()):
    """A ``tokenizers`` byte-level BPE without merges (every byte is a token), with ``special`` tokens and
    ``added`` (non-special) tokens that are matched whole."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    try:  # transformers >= 5
        from transformers.convert_slow_tokenizer import bytes_to_unicode
    except ImportError:  # transformers 4.x
        from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

    vocab = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in special])
    tok.add_tokens([AddedToken(a, special=False, normalized=False) for a in added])
    return tok


def _mistral_tokenizer():
    """The tokenizer of the tiny FLUX.2-dev pipeline: a ``PreTrainedTokenizerFast`` (byte-level BPE) with
    Mistral-Small's special tokens and chat format. FLUX.2-dev's own ``tokenizer`` is a ``PixtralProcessor``
    (which needs torchvision); for text prompts the pipeline only calls its ``apply_chat_template``, which renders
    the chat template and tokenizes it with this kind of tokenizer, so the result is the same.

    The pipeline's system message is one token here (Mistral's BPE makes it about 35), so that short test
    sequences still hold the prompt after it."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=_byte_level_bpe(_MISTRAL_SPECIAL, added=(SYSTEM_MESSAGE,)), bos_token="<s>",
        eos_token="</s>", unk_token="<unk>", pad_token="<pad>", model_max_length=131072,
    )
    tok.chat_template = _MISTRAL_CHAT_TEMPLATE
    return tok


def _qwen3_tokenizer():
    """A real ``Qwen2TokenizerFast`` (Klein's tokenizer class) with a byte-level vocabulary, Qwen3's special tokens,
    ``<think>`` / ``</think>`` and Qwen3's chat format (thinking disabled)."""
    from transformers import Qwen2TokenizerFast

    tok = Qwen2TokenizerFast(
        tokenizer_object=_byte_level_bpe(_QWEN3_SPECIAL, added=("<think>", "</think>")), eos_token="<|im_end|>",
        pad_token="<|endoftext|>", unk_token=None, bos_token=None, model_max_length=131072,
    )
    tok.chat_template = _QWEN3_CHAT_TEMPLATE
    return tok


def _tiny_transformer(guidance_embeds: bool, num_layers: int, num_single_layers: int, in_channels: int):
    from diffusers import Flux2Transformer2DModel

    return Flux2Transformer2DModel(
        patch_size=1, in_channels=in_channels, num_layers=num_layers, num_single_layers=num_single_layers,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=48, timestep_guidance_channels=256,
        axes_dims_rope=(4, 4, 4, 4), guidance_embeds=guidance_embeds,
    )


def _tiny_vae(latent_channels: int, sample_size: int):
    """An ``AutoencoderKLFlux2`` with 2x spatial compression and a non-trivial latent batch norm (random running
    mean / variance over the 4 x latent_channels patchified channels), so that decoding checks it is applied."""
    from diffusers import AutoencoderKLFlux2

    vae = AutoencoderKLFlux2(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"), block_out_channels=(8, 16), layers_per_block=1,
        latent_channels=latent_channels, norm_num_groups=4, sample_size=sample_size, use_quant_conv=False,
        use_post_quant_conv=False,
    )
    with torch.no_grad():
        vae.bn.running_mean.copy_(torch.randn_like(vae.bn.running_mean) * 0.5)
        vae.bn.running_var.copy_(torch.rand_like(vae.bn.running_var) * 2 + 0.25)
    return vae


def tiny_flux2_pipeline(seed: int = 0, sample_size: int = 32, num_layers: int = 1, num_single_layers: int = 1,
                        latent_channels: int = 4):
    """A real ``Flux2Pipeline`` (FLUX.2-dev) with tiny random components, every module in ``.eval()``: a
    ``Mistral3ForConditionalGeneration`` text encoder (30 text layers of width 16, a one-layer Pixtral vision
    tower), a ``Flux2Transformer2DModel`` with the guidance embedding, an ``AutoencoderKLFlux2`` and FLUX.2's
    scheduler config.

    Images of H x W pixels (multiples of 4) have latents (4 latent_channels, H / 4, W / 4) (the pipeline's
    patchified, batch-normalised layout), i.e. (H / 4) (W / 4) tokens of 16 channels. Building it does not touch
    the global RNG.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Pipeline
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    tokenizer = _mistral_tokenizer()
    ids = tokenizer.convert_tokens_to_ids
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        config = Mistral3Config(
            text_config=dict(
                model_type="mistral", vocab_size=len(tokenizer), hidden_size=16, intermediate_size=24,
                max_position_embeddings=512, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=30,
                rms_norm_eps=1e-5, rope_theta=1e9, sliding_window=None, bos_token_id=ids("<s>"),
                eos_token_id=ids("</s>"), pad_token_id=ids("<pad>"),
            ),
            vision_config=dict(model_type="pixtral", hidden_size=16, num_hidden_layers=1, num_attention_heads=4,
                               intermediate_size=24, image_size=32, patch_size=16, num_channels=3),
            image_token_index=ids("[IMG]"), spatial_merge_size=1, vision_feature_layer=-1,
        )
        text_encoder = Mistral3ForConditionalGeneration(config)
        transformer = _tiny_transformer(True, num_layers, num_single_layers, 4 * latent_channels)
        vae = _tiny_vae(latent_channels, sample_size)
    scheduler = FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER_CONFIG)
    pipe = Flux2Pipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                         transformer=transformer)
    return _finish(pipe, (transformer, vae, text_encoder))


def tiny_flux2_klein_pipeline(seed: int = 0, sample_size: int = 32, num_layers: int = 1, num_single_layers: int = 1,
                              latent_channels: int = 4, is_distilled: bool = False):
    """A real ``Flux2KleinPipeline`` (FLUX.2 [klein]) with tiny random components, every module in ``.eval()``: a
    ``Qwen3ForCausalLM`` text encoder (27 layers of width 16), a ``Flux2Transformer2DModel`` without guidance
    embedding, an ``AutoencoderKLFlux2`` and FLUX.2's scheduler config.

    ``is_distilled=False`` is the base model (FLUX.2-klein-base-*: true CFG against the empty prompt when
    ``guidance_scale > 1``); ``True`` the step-distilled one (FLUX.2-klein-4B / 9B: guidance ignored). Latents as
    :func:`tiny_flux2_pipeline`. Building it does not touch the global RNG.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = _qwen3_tokenizer()
    ids = tokenizer.convert_tokens_to_ids
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = Qwen3ForCausalLM(Qwen3Config(
            vocab_size=len(tokenizer), hidden_size=16, intermediate_size=24, num_hidden_layers=27,
            num_attention_heads=2, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
            bos_token_id=None, eos_token_id=ids("<|im_end|>"), pad_token_id=ids("<|endoftext|>"),
        ))
        transformer = _tiny_transformer(False, num_layers, num_single_layers, 4 * latent_channels)
        vae = _tiny_vae(latent_channels, sample_size)
    scheduler = FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER_CONFIG)
    pipe = Flux2KleinPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                              transformer=transformer, is_distilled=is_distilled)
    return _finish(pipe, (transformer, vae, text_encoder))
