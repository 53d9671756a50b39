"""The tiny FLUX.1 Kontext pipeline of the shapes editing task (a stock ``diffusers.FluxKontextPipeline``).

Components, built from configs (nothing downloaded):

* ``vae``: the shapes task's hand-set ``AutoencoderKL`` (:func:`~trl_flow.tasks.shapes.model.build_vae`) with a
  fourth latent channel that encodes to 0 and that decoding ignores: latents (B, 4, 16, 16), channels 0-2 = 2x2
  average pool of the image in [-1, 1], decoding = nearest 2x upsample. Four channels, not three: the pipeline
  takes an ``image`` with ``vae.config.latent_channels`` channels as latents, so with three it would skip
  encoding the (3-channel) source. 2 blocks, so the pipeline's ``vae_scale_factor`` is 2 and its 2x2 packing
  makes 64 tokens of 16 channels per 32 x 32 image.
  The source image is encoded the same way: another 64 tokens (ids with first coordinate 1), 128 image tokens.
* ``tokenizer`` / ``text_encoder``: a ``CLIPTokenizer`` in which every instruction word is one token
  (``model_max_length`` 8) and a frozen random ``CLIPTextModel`` (hidden 32, 2 layers): its pooled output.
* ``tokenizer_2`` / ``text_encoder_2``: a ``T5Tokenizer`` (Unigram) with one piece per instruction word (plus single
  characters as a fallback) and a frozen random ``T5EncoderModel`` (d_model 32, 2 layers): the text tokens;
  sample with ``max_sequence_length=EDIT_MAX_SEQUENCE_LENGTH`` (8: the longest instruction is 5 words + eos).
* ``transformer``: ``FluxTransformer2DModel`` (patch 1, 16 channels in, 2 double + 2 single blocks, 4 heads x 16,
  rope axes (4, 6, 6), no guidance embedding); the only trained part.
* ``scheduler``: ``FlowMatchEulerDiscreteScheduler`` with a fixed shift (``EDIT_SHIFT``, no dynamic shifting).

Sample with ``pipe(image=source_pil, prompt=instruction, height=32, width=32, max_area=32 * 32,
_auto_resize=False, num_inference_steps=..., max_sequence_length=EDIT_MAX_SEQUENCE_LENGTH)`` or
:func:`edit_generate`; train it through ``FluxKontextAdapter(pipe, source_size="output")`` (or a trainer config
with ``source_image_size="output"``). No classifier-free guidance: one transformer pass per step.

Committed base (``scripts/pretrain_shapes_edit.py --minutes 22 --batch-size 32 --num-pairs 20000``: 2,374 steps,
24.9 min, 1 thread, raw weights; ``edit_base_model/training_info.json``): strict / partial ``shapes_edit`` success at
10 steps on 256 fresh scenes, train instructions 0.047 / 0.516, held-out instructions 0.055 / 0.500. Its images are
clean (cleanliness 0.98) but its shapes are often malformed or misplaced by a pixel or two; per instruction
(``benchmarks/results/shapes_edit_base/per_instruction.json``, 64 scenes each) strict ranges from 0 (11 of 39 train
instructions, mostly squares and moves) to 0.156.
"""

from __future__ import annotations

import os

import torch

from .edit import EDIT_VOCABULARY
from .model import build_tokenizer, build_vae

EDIT_BASE_MODEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "edit_base_model")
EDIT_MAX_SEQUENCE_LENGTH = 8
EDIT_TOKENIZER_MAX_LENGTH = 8
EDIT_SHIFT = 3.0
EDIT_NUM_INFERENCE_STEPS = 10
EDIT_RESOLUTION = 32
TEXT_DIM = 32

EDIT_TRANSFORMER_CONFIG = dict(
    patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=4,
    joint_attention_dim=TEXT_DIM, pooled_projection_dim=TEXT_DIM, guidance_embeds=False, axes_dims_rope=(4, 6, 6),
)


def build_t5_tokenizer(words=EDIT_VOCABULARY, max_length: int = 512):
    """A ``T5Tokenizer`` in which each of ``words`` is one piece (``"\u2581word"``); other text falls back to
    single characters."""
    import string

    from transformers import T5Tokenizer

    chars = sorted(set(string.ascii_lowercase))
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    vocab += [("\u2581" + w, -1.0) for w in words]
    vocab += [(c, -5.0) for c in chars] + [("\u2581" + c, -5.5) for c in chars if c not in words]
    tok = T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=max_length)
    assert all(len(tok.tokenize(w)) == 1 for w in words)
    return tok


def build_edit_text_encoders(seed: int = 0):
    """(CLIP tokenizer, ``CLIPTextModel``, T5 tokenizer, ``T5EncoderModel``), frozen, in eval mode."""
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    tok = build_tokenizer(EDIT_VOCABULARY, max_length=EDIT_TOKENIZER_MAX_LENGTH)
    tok2 = build_t5_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        clip = CLIPTextModel(CLIPTextConfig(
            vocab_size=len(tok), hidden_size=TEXT_DIM, intermediate_size=2 * TEXT_DIM, num_hidden_layers=2,
            num_attention_heads=2, max_position_embeddings=EDIT_TOKENIZER_MAX_LENGTH, projection_dim=TEXT_DIM,
            bos_token_id=0, eos_token_id=1, pad_token_id=1))
        t5 = T5EncoderModel(T5Config(
            vocab_size=len(tok2), d_model=TEXT_DIM, d_kv=8, d_ff=2 * TEXT_DIM, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", dropout_rate=0.0))
    for m in (clip, t5):
        m.requires_grad_(False)
        m.eval()
    return tok, clip, tok2, t5


def build_edit_transformer(seed: int = 0):
    from diffusers import FluxTransformer2DModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return FluxTransformer2DModel(**EDIT_TRANSFORMER_CONFIG)


def build_edit_scheduler(shift: float = EDIT_SHIFT):
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift, use_dynamic_shifting=False)


def build_edit_pipeline(seed: int = 0, shift: float = EDIT_SHIFT, transformer=None):
    """An untrained editing pipeline (random transformer unless given), every module in ``.eval()``."""
    from diffusers import FluxKontextPipeline

    tok, clip, tok2, t5 = build_edit_text_encoders(seed + 1)
    pipe = FluxKontextPipeline(
        scheduler=build_edit_scheduler(shift), vae=build_vae(latent_channels=4), text_encoder=clip, tokenizer=tok,
        text_encoder_2=t5, tokenizer_2=tok2,
        transformer=transformer if transformer is not None else build_edit_transformer(seed))
    return _eval(pipe)


def _eval(pipe):
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2"):
        getattr(pipe, name).eval()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def load_edit_base_pipeline(device="cpu", dtype=torch.float32, path: str | None = None):
    """The committed editing base (``edit_base_model/``, or a ``save_pretrained`` folder ``path``) as a
    ``diffusers.FluxKontextPipeline``, every module in ``.eval()``, progress bar off. Train it with
    ``FluxKontextAdapter(pipe, source_size="output")`` or ``source_image_size="output"`` in the trainer config
    (the default ``"auto"`` would encode the 32 x 32 sources at ~1024 px)."""
    from diffusers import FluxKontextPipeline

    pipe = FluxKontextPipeline.from_pretrained(path or EDIT_BASE_MODEL_DIR, dtype=dtype).to(device)
    return _eval(pipe)


@torch.no_grad()
def edit_generate(pipe, prompts: list[str], sources, seed: int | None = 0,
                  num_inference_steps: int = EDIT_NUM_INFERENCE_STEPS, batch_size: int = 256) -> torch.Tensor:
    """One edit per (instruction, source) with the pipeline itself: float (B, 3, 32, 32) in [0, 1]. ``sources``: RGB
    PIL images 32 x 32. Noise is drawn on the CPU from ``seed`` (None: the pipeline's own)."""
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    out = []
    for i in range(0, len(prompts), batch_size):
        chunk, srcs = list(prompts[i: i + batch_size]), list(sources[i: i + batch_size])
        latents = None
        if generator is not None:
            c = pipe.transformer.config.in_channels // 4
            h = 2 * (EDIT_RESOLUTION // (pipe.vae_scale_factor * 2))
            noise = torch.randn((len(chunk), c, h, h), generator=generator)
            latents = pipe._pack_latents(noise, len(chunk), c, h, h).to(pipe.device, pipe.transformer.dtype)
        images = pipe(image=srcs, prompt=chunk, height=EDIT_RESOLUTION, width=EDIT_RESOLUTION,
                      max_area=EDIT_RESOLUTION ** 2, _auto_resize=False, num_inference_steps=num_inference_steps,
                      max_sequence_length=EDIT_MAX_SEQUENCE_LENGTH, latents=latents, output_type="pt").images
        out.append(images.float().cpu())
    return torch.cat(out)
