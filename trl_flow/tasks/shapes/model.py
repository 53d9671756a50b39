"""The tiny StableDiffusion3 pipeline of the shapes task.

Components (all standard diffusers / transformers classes, so the pipeline is a stock
``diffusers.StableDiffusion3Pipeline``):

* ``tokenizer`` / ``tokenizer_2``: ``CLIPTokenizer`` whose BPE merges turn every grammar word into one token
  (built in memory by :func:`build_tokenizer`), ``model_max_length`` 16.
* ``text_encoder`` / ``text_encoder_2``: frozen random ``CLIPTextModelWithProjection`` (hidden 16, 2 layers,
  projection 32); no T5 (``text_encoder_3=None``): the pipeline appends ``max_sequence_length`` zero tokens.
  Text sequence = 16 CLIP tokens (2 x 16 features concatenated = 32) + ``MAX_SEQUENCE_LENGTH`` zero tokens;
  pooled = 2 x 32 = 64.
* ``vae``: a 2-block ``AutoencoderKL`` with hand-set weights: encoder = 2x2 average pool of the image in
  [-1, 1], decoder = nearest 2x upsample. Latents (B, 3, 16, 16), ``scaling_factor`` 1, ``shift_factor`` 0.
  Round-trip error < 1e-5 on images drawn on the 2x2 grid (see render.py).
* ``transformer``: ``SD3Transformer2DModel`` sample 16, patch 2 (64 image tokens), 4 layers, 4 heads x 16,
  about 0.59M parameters; the only trained part.
* ``scheduler``: ``FlowMatchEulerDiscreteScheduler`` with the shift stored in the checkpoint
  (``BASE_SHIFT``).

Sampling must pass ``max_sequence_length=MAX_SEQUENCE_LENGTH``: the pipeline's default, 256, appends 256 zero
"T5" tokens the model never saw in training, which drags strict accuracy from about 0.27 to 0.06 (test prompts,
guidance 3, 20 steps). :func:`generate` passes it.

Committed base checkpoint (``scripts/pretrain_shapes.py --minutes 32``: 9,035 steps, 22 min, 1 thread; raw
weights, shift 3; see ``base_model/training_info.json``): strict / partial accuracy at guidance 3, 20 steps,
40 prompts per category, with today's detector (corner-occupancy square rule): train prompts 0.420 / 0.687,
held-out test prompts 0.340 / 0.643 (0.325 / 0.632 and 0.265 / 0.580 with the earlier fill-ratio rule, as the
training log recorded). ``base_model_noisy/`` (``load_base_pipeline(variant="noisy")``) is that checkpoint
fine-tuned on noisy captions (docs/shapes.md): train 0.360 / 0.655, test 0.340 / 0.625.
"""

from __future__ import annotations

import math
import os

import torch

from .grammar import VOCABULARY

BASE_MODEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "base_model")
# The noisy-caption base: BASE_MODEL_DIR fine-tuned on captions with planted errors (relations flipped, colours
# of a pair swapped, counts off by one; see base_model_noisy/training_info.json and docs/shapes.md).
NOISY_BASE_MODEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "base_model_noisy")
BASE_MODEL_VARIANTS: dict[str, str] = {"clean": BASE_MODEL_DIR, "noisy": NOISY_BASE_MODEL_DIR}

DEFAULT_RESOLUTION = 32
DEFAULT_NUM_INFERENCE_STEPS = 20
DEFAULT_GUIDANCE_SCALE = 3.0
MAX_SEQUENCE_LENGTH = 1  # zero "T5" tokens appended by the pipeline (no T5 encoder)
TOKENIZER_MAX_LENGTH = 16  # CLIP tokens (longest prompt: 10 words + bos + eos)
BASE_SHIFT = 3.0  # scheduler shift of the committed checkpoint (also written in its scheduler config)

TEXT_HIDDEN = 16
TEXT_PROJECTION = 32
LATENT_CHANNELS = 3
VAE_CHANNELS = 12  # per colour channel c: [x_c, -x_c, K, -K] (see build_vae)
VAE_CONSTANT = 1000.0

TRANSFORMER_CONFIG = dict(
    sample_size=16,
    patch_size=2,
    in_channels=LATENT_CHANNELS,
    out_channels=LATENT_CHANNELS,
    num_layers=4,
    attention_head_dim=16,
    num_attention_heads=4,
    joint_attention_dim=2 * TEXT_HIDDEN,
    caption_projection_dim=64,
    pooled_projection_dim=2 * TEXT_PROJECTION,
    pos_embed_max_size=8,
)

BOS_TOKEN = "<|startoftext|>"
EOS_TOKEN = "<|endoftext|>"


# ------------------------------------------------------------------------------------------------ tokenizer


def build_tokenizer(words=VOCABULARY, max_length: int = TOKENIZER_MAX_LENGTH):
    """A ``CLIPTokenizer`` in which every word of ``words`` is a single token.

    Vocabulary: bos (0), eos (1, also pad and unk), the letters a-z with and without ``</w>``, then merge
    products. Merges are added greedily: while a word still splits into several pieces, the first two pieces
    are merged by a new, lowest-priority merge (appending such merges never changes the tokenization of words
    already handled). Unknown words fall back to letters.
    """
    from transformers import CLIPTokenizer

    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    vocab = {BOS_TOKEN: 0, EOS_TOKEN: 1}
    for ch in letters:
        vocab.setdefault(ch, len(vocab))
        vocab.setdefault(ch + "</w>", len(vocab))
    merges: list[tuple[str, str]] = []

    def make():
        return CLIPTokenizer(vocab=dict(vocab), merges=list(merges), model_max_length=max_length)

    tok = make()
    for word in words:
        for _ in range(4 * len(word)):
            pieces = tok.tokenize(word)
            if len(pieces) == 1:
                break
            merges.append((pieces[0], pieces[1]))
            vocab.setdefault(pieces[0] + pieces[1], len(vocab))
            tok = make()
        else:
            raise RuntimeError(f"could not make {word!r} a single token")
    assert all(len(tok.tokenize(w)) == 1 for w in words)
    return tok


# ------------------------------------------------------------------------------------------- text encoders


def build_text_encoder(vocab_size: int, seed: int):
    """A frozen random ``CLIPTextModelWithProjection``: hidden 16, 2 layers, 2 heads, projection 32."""
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=TEXT_HIDDEN,
        intermediate_size=4 * TEXT_HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=TOKENIZER_MAX_LENGTH,
        projection_dim=TEXT_PROJECTION,
        bos_token_id=0,
        eos_token_id=1,  # != 2: pooled output taken at the first eos token
        pad_token_id=1,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        # default CLIP initialisation: word and position embeddings at the same scale (0.02), so the hidden
        # states keep word order, which binding and position prompts need (the SD3 transformer has no position
        # embedding for text tokens)
        model = CLIPTextModelWithProjection(config)
    model.requires_grad_(False)
    return model.eval()


# ------------------------------------------------------------------------------------------------------- VAE


def build_vae(latent_channels: int = LATENT_CHANNELS):
    """``AutoencoderKL`` with hand-set weights: latents (B, 3, H/2, W/2) = 2x2 average pool of the image
    (B, 3, H, W) in [-1, 1]; decoding = nearest 2x upsample. ``latent_channels`` > 3 appends channels that
    encode to exactly 0 and that decoding ignores (the editing pipeline needs 4: FluxKontextPipeline takes an
    ``image`` with ``latent_channels`` channels for latents, so a 3-channel VAE would skip encoding RGB sources).

    Every ResNet's second conv is zero (identity blocks) and the mid blocks have no attention. The GroupNorm +
    SiLU before each ``conv_out`` would distort the signal, so each colour channel travels as a group of four
    channels [x, -x, K, -K] (K = 1000): the group mean is exactly 0, its variance (mean(x^2) + K^2) / 2, so the
    norm is a near-constant scale, and ``silu(z) - silu(-z) = z`` undoes the SiLU exactly.
    """
    from diffusers import AutoencoderKL

    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(VAE_CHANNELS, VAE_CHANNELS),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=3,  # one group of four channels [x, -x, K, -K] per colour channel
        sample_size=32,
        scaling_factor=1.0,
        shift_factor=0.0,
        force_upcast=False,
        use_quant_conv=False,
        use_post_quant_conv=False,
        mid_block_add_attention=False,
    )
    k = VAE_CONSTANT
    scale = k / math.sqrt(2.0)  # undoes the GroupNorm's 1 / sqrt((mean(x^2) + K^2) / 2)

    with torch.no_grad():
        for p in vae.parameters():
            p.zero_()
        for m in vae.modules():  # norms: identity affine
            if isinstance(m, torch.nn.GroupNorm):
                m.weight.fill_(1.0)

        def spread(conv, n_in):
            """conv_in (centre tap): input channel c -> [x_c, -x_c, K, -K]."""
            for c in range(n_in):
                conv.weight[4 * c, c, 1, 1] = 1.0
                conv.weight[4 * c + 1, c, 1, 1] = -1.0
                conv.bias[4 * c + 2] = k
                conv.bias[4 * c + 3] = -k

        def gather(conv, n_out):
            """conv_out (centre tap): silu(x_c) - silu(-x_c), rescaled."""
            for c in range(n_out):
                conv.weight[c, 4 * c, 1, 1] = scale
                conv.weight[c, 4 * c + 1, 1, 1] = -scale

        enc, dec = vae.encoder, vae.decoder
        spread(enc.conv_in, 3)
        gather(enc.conv_out, 3)  # latent channels >= 3 (if any) stay 0
        enc.conv_out.bias[latent_channels:] = -30.0  # log-variance: std exp(-15), sampling = mean
        for block in enc.down_blocks:
            for ds in block.downsamplers or []:
                for c in range(VAE_CHANNELS):  # 2x2 average pool (taps 0..1 of the stride-2 conv)
                    ds.conv.weight[c, c, :2, :2] = 0.25
        spread(dec.conv_in, 3)
        gather(dec.conv_out, 3)
        for block in dec.up_blocks:
            for us in block.upsamplers or []:
                for c in range(VAE_CHANNELS):  # nearest upsample, then identity conv
                    us.conv.weight[c, c, 1, 1] = 1.0
    vae.requires_grad_(False)
    return vae.eval()


# ------------------------------------------------------------------------------------------------- pipeline


def build_transformer(seed: int = 0):
    """A freshly initialised ``SD3Transformer2DModel`` with ``TRANSFORMER_CONFIG``."""
    from diffusers import SD3Transformer2DModel

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return SD3Transformer2DModel(**TRANSFORMER_CONFIG)


def build_scheduler(shift: float = BASE_SHIFT):
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)


def build_pipeline(seed: int = 0, shift: float = BASE_SHIFT, transformer=None):
    """A complete untrained pipeline (random transformer unless given), everything in ``.eval()``."""
    from diffusers import StableDiffusion3Pipeline

    tok = build_tokenizer()
    tok2 = build_tokenizer()
    pipe = StableDiffusion3Pipeline(
        transformer=transformer if transformer is not None else build_transformer(seed),
        scheduler=build_scheduler(shift),
        vae=build_vae(),
        text_encoder=build_text_encoder(len(tok), seed=seed + 1),
        tokenizer=tok,
        text_encoder_2=build_text_encoder(len(tok2), seed=seed + 2),
        tokenizer_2=tok2,
        text_encoder_3=None,
        tokenizer_3=None,
    )
    _eval(pipe)
    return pipe


def _eval(pipe):
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2"):
        module = getattr(pipe, name, None)
        if module is not None:
            module.eval()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def load_base_pipeline(device="cpu", dtype=torch.float32, path: str | None = None, variant: str = "clean"):
    """Loads a committed base checkpoint as a ``diffusers.StableDiffusion3Pipeline`` with every component in
    ``.eval()`` and the progress bar off.

    ``variant``: ``"clean"`` (the default: ``base_model/``, trained on clean captions) or ``"noisy"``
    (``base_model_noisy/``, the same model fine-tuned on captions with planted errors, so that it is partly
    right where RL post-training can fix it), or a ``save_pretrained`` folder (name or path, as ``from_pretrained``
    takes either; e.g. one written by scripts/pretrain_shapes.py). ``path`` (a folder) overrides ``variant``.

    Sample with ``pipe(prompt, height=32, width=32, num_inference_steps=DEFAULT_NUM_INFERENCE_STEPS,
    guidance_scale=DEFAULT_GUIDANCE_SCALE, max_sequence_length=MAX_SEQUENCE_LENGTH)`` or :func:`generate`.
    """
    from diffusers import StableDiffusion3Pipeline

    if path is None:
        if variant in BASE_MODEL_VARIANTS:
            path = BASE_MODEL_VARIANTS[variant]
        elif os.path.isdir(variant):
            path = variant
        else:
            raise ValueError(f"unknown base model variant {variant!r}: expected one of {sorted(BASE_MODEL_VARIANTS)} "
                             "or an existing save_pretrained folder")
    pipe = StableDiffusion3Pipeline.from_pretrained(
        path, text_encoder_3=None, tokenizer_3=None, dtype=dtype
    )
    pipe = pipe.to(device)
    return _eval(pipe)


@torch.no_grad()
def generate(
    pipe,
    prompts: list[str],
    seed: int | None = 0,
    num_inference_steps: int = DEFAULT_NUM_INFERENCE_STEPS,
    guidance_scale: float = DEFAULT_GUIDANCE_SCALE,
    batch_size: int = 128,
) -> torch.Tensor:
    """Samples one image per prompt with the recommended settings: float tensor (B, 3, 32, 32) in [0, 1]."""
    generator = None if seed is None else torch.Generator(device="cpu").manual_seed(seed)
    out = []
    for i in range(0, len(prompts), batch_size):
        chunk = list(prompts[i : i + batch_size])
        latents = None
        if generator is not None:  # CPU noise, so results do not depend on the device
            h = DEFAULT_RESOLUTION // pipe.vae_scale_factor
            latents = torch.randn((len(chunk), pipe.transformer.config.in_channels, h, h), generator=generator)
            latents = latents.to(pipe.device, pipe.transformer.dtype)
        images = pipe(
            chunk,
            height=DEFAULT_RESOLUTION,
            width=DEFAULT_RESOLUTION,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            max_sequence_length=MAX_SEQUENCE_LENGTH,
            latents=latents,
            output_type="pt",
        ).images
        out.append(images.float().cpu())
    return torch.cat(out)
