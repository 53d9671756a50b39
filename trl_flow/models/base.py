"""The small interface a trainer needs from a diffusers pipeline.

An adapter wraps one pipeline family (SD3, FLUX.1, Wan2.1) and exposes five operations: encode prompts, build the
sigma schedule, draw initial noise, predict the (guided) velocity, decode latents. It uses the pipeline's own
components and methods, so whatever ``pipe()`` does, the trainer does too.

Memory of a rollout. For N samples, K steps, latents of shape L and decoded samples of shape O ((3, H, W), or
(F, 3, H, W) for video) a rollout keeps, in float32 unless noted::

    states  (N, K + 1, *L)   N (K + 1) prod(L) 4 bytes
    means   (N, K, *L)       N K prod(L) 4
    log_probs (N, K)         N K 4,  train_mask (N, K) bool: N K
    decoded (N, *O)          N prod(O) 4

plus the prompt embeddings (their size depends on the text encoders), see :meth:`FlowAdapter.rollout_bytes`.
Per sample: Wan2.1-T2V-1.3B, 33 frames of 240 x 416, 20 steps: L = (16, 9, 30, 52), 18.9 MB of states + 18.0 MB
of means + 39.5 MB of decoded frames; FLUX.1-dev at 512 x 512, 6 steps: L = (16, 64, 64), 3.4 MB + 3.1 MB of image.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..storage import LORA_WEIGHT_NAME, follow_umask

PromptEmbeds = dict[str, torch.Tensor]
"""Prompt conditioning: tensors whose first dim is the batch (B, ...). Index it with :func:`index_embeds`."""


def index_embeds(embeds: PromptEmbeds, index) -> PromptEmbeds:
    """Select rows (a slice, a list or a LongTensor of indices) of every tensor."""
    return {k: v[index] for k, v in embeds.items()}


def cat_embeds(parts: list[PromptEmbeds]) -> PromptEmbeds:
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


@dataclass
class Schedule:
    """A sampling schedule: ``sigmas`` (K + 1,) float32 from 1 to 0 (shift applied) and the model's
    ``timesteps`` (K,) exactly as the pipeline passes them to its transformer."""

    sigmas: torch.Tensor
    timesteps: torch.Tensor

    @property
    def num_steps(self) -> int:
        return len(self.timesteps)


#: The attention projections of a joint (MM-DiT) attention block, image and text streams: SD3's LoRA targets and
#: the attention part of FLUX's (Flow-GRPO's published targets).
JOINT_ATTENTION_PROJECTIONS: tuple[str, ...] = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
)


class FlowAdapter:
    """Base class of the pipeline adapters: the contract between a diffusers pipeline family and every trainer.

    A subclass implements :meth:`encode_prompts`, :meth:`schedule`, :meth:`latent_shape`, :meth:`velocity` and
    :meth:`decode` (and sets :attr:`pipeline_class`); the rest has defaults. It is built as
    ``AdapterClass(pipe, **options)`` and registered with :func:`trl_flow.models.register_adapter`; the guide with a
    worked example is docs/adding_a_model.md. Notation: B a batch, L = ``latent_shape(H, W)`` (e.g. (C, h, w); video
    (C, F', h, w)), K the number of sampling steps.

    What the trainers rely on:

    * **Parity.** With the ``ode`` kernel, ``initial_noise`` -> ``velocity`` at each ``schedule`` step -> Euler
      ``x + (sigma[k + 1] - sigma[k]) v`` reproduces ``pipe(..., output_type="latent")`` from the same noise (bit for
      bit in float32), and ``decode`` is the pipeline's decoded output. Use the pipeline's own methods for this.
    * **Determinism.** Every operation is a pure function of its inputs and the weights: no global RNG, no state
      carried between calls (caches keyed by shape are fine). The only randomness is ``initial_noise``'s
      ``generator``. A sample's result must not depend on which other samples share its batch (the trainer samples,
      re-scores and evaluates in different chunkings).
    * **Precision.** Inputs ``x`` and returned velocities / latents / images are float32; an adapter casts to the
      transformer's or VAE's dtype inside (bf16 training: the trainer wraps the calls in autocast).
    * **Gradients.** The trainers call ``velocity`` with gradients enabled on the LoRA-wrapped ``model`` and
      back-propagate through it; never wrap it in ``torch.no_grad()`` and never cache its output.

    A family that trains more than ``pipe.transformer`` (Wan2.2's two experts) overrides the hooks after
    :meth:`decode` (``trained_components``, ``trainable_module``, ``trainable_steps``, the LoRA file hooks).
    """

    #: LoRA target modules used when the config gives none.
    default_lora_target_modules: tuple[str, ...] = ()
    #: The diffusers pipeline class whose ``save_lora_weights`` writes the adapter.
    pipeline_class = None
    #: The Hub ``pipeline_tag`` of a model trained on this family (read by the model card).
    pipeline_tag = "text-to-image"
    #: True when one :meth:`velocity` call runs only a part of :meth:`trainable_module` (Wan2.2's two trained
    #: experts, one per step): multi-process DDP then looks for unused parameters.
    partial_forward = False
    #: Family-specific config fields this adapter reads (``experts``, ``guidance_scale_2``): the trainer refuses a
    #: non-default value of one it does not read, naming the field, before any compute.
    reads_config_fields: tuple[str, ...] = ()
    #: What conditions a sample: ``"text"`` (the prompt) or ``"text_and_image"`` (an editing family: the prompt
    #: and a source image). An editing adapter's :meth:`encode_prompts` takes ``images=``, a list of B RGB
    #: ``PIL.Image`` sources (the dataset's :attr:`source_column`, decoded by :mod:`trl_flow.editing`), and stores
    #: its image conditioning in the returned dict (tensors with the batch first and a fixed shape, like the text's).
    conditioning = "text"
    #: The dataset column holding the source images of an editing adapter.
    source_column = "source_image"
    #: How the pipeline pads a batch of prompts: ``"max_length"`` (to a fixed length: a prompt's embedding depends
    #: on it and on the batch size only, so the trainer encodes each distinct prompt of an iteration once) or
    #: ``"longest"`` (to the batch's longest prompt, Qwen-Image: the trainer encodes each distinct sampling chunk
    #: once). See :mod:`trl_flow.engine.prompt_encoding`.
    prompt_padding = "max_length"

    def __init__(self, pipe):
        self.pipe = pipe

    def configure(self, config) -> None:
        """Read the family-specific fields of a trainer config (e.g. Wan's ``num_frames``) and check them against
        the pipeline. Called once by the trainer, before any compute; raises ``ValueError`` naming the field."""

    @property
    def resolution_multiple(self) -> int:
        """Height and width must be multiples of this (VAE scale factor x transformer patch size)."""
        return self.pipe.vae_scale_factor * getattr(self.transformer.config, "patch_size", 1)

    def output_shape(self, height: int, width: int) -> tuple[int, ...]:
        """Shape of one decoded sample as the rewards receive it: (3, H, W), or (F, 3, H, W) for video."""
        return (3, height, width)

    def rollout_bytes(self, n: int, num_steps: int, height: int, width: int) -> int:
        """Bytes a rollout of ``n`` samples over ``num_steps`` steps stores besides the prompt embeddings: states
        (n, K + 1, *L) and means (n, K, *L) float32, log-probs (n, K) float32, the train mask (n, K) bool and the
        decoded samples (n, *output_shape) float32."""
        import math

        lat = math.prod(self.latent_shape(height, width))
        out = math.prod(self.output_shape(height, width))
        K = num_steps
        return n * (K + 1) * lat * 4 + n * K * lat * 4 + n * K * 4 + n * K + n * out * 4

    @property
    def transformer(self) -> torch.nn.Module:
        return self.pipe.transformer

    @property
    def device(self) -> torch.device:
        return self.transformer.device

    def encode_prompts(self, prompts: list[str], guidance: bool, max_sequence_length: int) -> PromptEmbeds:
        """Prompt conditioning for ``prompts`` (B strings): a dict of tensors, each with the batch first (B, ...),
        on :attr:`device`, in the text encoders' dtype.

        * Keys: the pipeline's own ``__call__`` argument names (``prompt_embeds``, ``pooled_prompt_embeds``, ...),
          so ``pipe(**embeds)`` takes them (benchmarks/overhead.py and full_size.py rely on this). Where the
          pipeline takes another form (Z-Image: a list of unpadded tensors per prompt), store padded tensors with a
          mask and add ``pipeline_embeds(embeds)`` returning the pipeline's arguments.
        * ``guidance`` is ``guidance_scale > 1``: return the unconditional embeddings too
          (``negative_prompt_embeds``, ...) when the family does classifier-free guidance with two branches;
          distilled-guidance families ignore it.
        * Shapes must not depend on the other prompts of the batch: pad to ``max_sequence_length`` (as the
          pipelines do), because the trainer encodes in chunks and concatenates them (:func:`cat_embeds`), then
          indexes single rows (:func:`index_embeds`). A family whose pipeline trims to the longest prompt must pad
          (and pass a mask) here.
        * Called under ``torch.no_grad()`` (text encoders are frozen); the result is stored in the rollout.
        """
        raise NotImplementedError

    def prompt_token_limits(self, max_sequence_length: int) -> dict[str, int]:
        """{tokenizer component name: the tokens of a prompt the pipeline keeps} (the trainer warns, once, about a
        longer prompt; :meth:`prompt_token_counts` counts them). Default, as SD3 / FLUX.1 / Wan cut: every
        ``tokenizer*`` component, a T5-family one at ``max_sequence_length``, the others (CLIP) at their
        ``model_max_length``. A family whose pipeline cuts elsewhere, or counts a chat template, overrides both."""
        out = {}
        for name, tok in self.pipe.components.items():
            if name.startswith("tokenizer") and tok is not None and hasattr(tok, "model_max_length"):
                limit = max_sequence_length if "T5" in type(tok).__name__ else tok.model_max_length
                out[name] = min(limit, tok.model_max_length)
        return out

    def prompt_token_counts(self, prompts: list[str], name: str) -> list[int]:
        """Each prompt's length in tokens as the pipeline's tokenizer ``name`` counts it against
        :meth:`prompt_token_limits` (special and template tokens included)."""
        return [len(ids) for ids in self.pipe.components[name](list(prompts), verbose=False)["input_ids"]]

    def check_source_sizes(self, sizes: list[tuple[int, int]], where: str) -> None:
        """Editing adapters: raise ``ValueError`` (naming ``where`` and the rows) if the sources of these (width,
        height) sizes, one per dataset row, cannot be used together, e.g. because their conditioning shapes differ
        (rows of different shapes cannot share a batch). Called at set-up, before any compute. Default: accept."""

    def check_size(self, height: int, width: int) -> None:
        """Raise ``ValueError`` naming height/width if the model cannot generate at this size (before any compute)."""

    def schedule(self, num_inference_steps: int, height: int, width: int) -> Schedule:
        """The pipeline's sampling schedule for K = ``num_inference_steps`` at this size (resolution-dependent
        shifts included), on :attr:`device`: ``sigmas`` (K + 1,) float32 decreasing from 1 to 0 and ``timesteps``
        (K,) exactly as the pipeline passes them to its scheduler/transformer. Build it with the pipeline's own
        helpers (``retrieve_timesteps``, ``calculate_shift``) so it is the pipeline's schedule.

        Timestep convention: ``timesteps`` must be ``sigmas[:-1] * scale`` (flow matching: scale 1000 in diffusers'
        schedulers); StepwiseFlowGRPO evaluates :meth:`velocity` between steps at ``sigma * scale`` and refuses a
        schedule that is not proportional. Called once per rollout (it may set the scheduler's state)."""
        raise NotImplementedError

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        """The shape L of one sample's latent state, without the batch: what the kernels, log-probs and KL work on.
        Store latents *unpacked* when the transformer packs them (FLUX: (C, h, w)); pack inside :meth:`velocity`
        (a permutation does not change a Gaussian kernel's log-prob)."""
        raise NotImplementedError

    def initial_noise(self, n: int, height: int, width: int, generator: torch.Generator) -> torch.Tensor:
        """(n, *latent_shape) float32 standard normal noise drawn with ``generator`` (on its device; the trainers
        pass a CPU generator and move the result). Override it only where the pipeline draws its noise in another
        shape or order (e.g. packed), so that ``pipe(generator=torch.Generator().manual_seed(s))`` starts from
        ``initial_noise(n, H, W, torch.Generator().manual_seed(s))``. Draw from ``generator`` only."""
        shape = (n, *self.latent_shape(height, width))
        return torch.randn(shape, generator=generator, device=generator.device, dtype=torch.float32)

    def velocity(self, model, x, timestep, embeds: PromptEmbeds, guidance_scale: float,
                 detach_uncond: bool = False) -> torch.Tensor:
        """Guided velocity (B, *latent_shape) float32 of ``model`` at states ``x`` (B, *latent_shape) float32.

        * ``model``: the transformer to call, *not* necessarily ``self.transformer`` (the trainer passes the
          LoRA-wrapped / accelerate-prepared policy, or the reference with the LoRA disabled). Call it with the
          pipeline's keyword arguments; cast ``x`` and the embeddings to the transformer's dtype inside.
        * ``timestep``: a 0-d tensor (one of ``schedule().timesteps``) or a (B,) tensor of per-sample timesteps on
          the same scale (StepwiseFlowGRPO); convert it as the pipeline does (e.g. FLUX divides by 1000).
        * ``embeds``: rows of :meth:`encode_prompts`' output matching ``x``.
        * ``guidance_scale``: the trainer's ``guidance_scale``, applied as the pipeline applies its guidance
          (two-branch CFG ``v_u + g (v_c - v_u)`` when ``guidance_scale > 1`` and the negative embeddings are
          present; or a distilled guidance embedding in one pass; or the family's own variant, e.g. CFG-renorm).
        * ``detach_uncond``: with two-branch guidance, detach the unconditional prediction (same value, no gradient
          through that branch; ``guidance_grad="cond_only"``). Ignore it when there is one branch.

        The sign and scale are the scheduler's: one Euler step is ``x + (sigma_next - sigma) * v``."""
        raise NotImplementedError

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Samples (B, *output_shape) float32 in [0, 1] from latents (B, *latent_shape) float32: images
        (B, 3, H, W), videos (B, F, 3, H, W). Undo the VAE's scaling/shift (or latents mean/std) as the pipeline
        does and map [-1, 1] to [0, 1] with ``(x / 2 + 0.5).clamp(0, 1)``, so the result equals the pipeline's
        ``output_type="pt"`` output. Called under ``torch.no_grad()``; the rewards get exactly this."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------------- what is trained
    def trained_components(self) -> tuple[str, ...]:
        """Names of the pipeline components whose weights are trained (kept in float32 under ``finetune="full"``,
        checked for a leftover LoRA). Default: ``("transformer",)``."""
        return ("transformer",)

    def trainable_module(self) -> torch.nn.Module:
        """The one module the trainer trains (LoRA or full), prepares and passes to :meth:`velocity` as ``model``.
        Default: ``pipe.transformer``; a family with several trained transformers returns a module holding them
        (Wan2.2: :class:`~trl_flow.models.wan22.WanExperts`)."""
        return self.pipe.transformer

    def trainable_steps(self, schedule: Schedule) -> torch.Tensor | None:
        """(K,) bool: the steps whose velocity depends on the trained weights, or None for all. The others are
        sampled with the ODE kernel and never trained (Wan2.2 with one expert trained)."""
        return None

    # ----------------------------------------------------------------------------------------------- LoRA files
    def lora_weight_names(self) -> tuple[str, ...]:
        """The LoRA file(s) :meth:`save_lora_weights` writes; the first is the main one."""
        return (LORA_WEIGHT_NAME,)

    def lora_load_code(self, source: str) -> str:
        """Python that loads a saved LoRA from ``source`` into ``pipe`` (for the model card)."""
        return f'pipe.load_lora_weights("{source}")'

    def save_lora_weights(self, save_directory: str, state_dict: dict, metadata: dict | None) -> None:
        """Write a transformer LoRA (peft state dict) with the pipeline class's own ``save_lora_weights``, so that
        ``pipe.load_lora_weights(save_directory)`` loads it.

        The file is byte-identical for identical weights (set-valued metadata such as ``target_modules`` is sorted:
        a set's order depends on the process's string hash seed) and gets the permissions of any file the user
        creates (safetensors writes it 0600; here it follows the umask, like the other checkpoint files)."""
        self._write_lora(save_directory, state_dict, metadata, self.lora_weight_names()[0])

    def read_lora_weights(self, input_dir: str) -> dict:
        """What :meth:`save_lora_weights` wrote in ``input_dir``, as a peft state dict of :meth:`trainable_module`."""
        return self._read_lora(input_dir, self.lora_weight_names()[0])

    def _write_lora(self, save_directory: str, state_dict: dict, metadata: dict | None, weight_name: str) -> None:
        if metadata is not None:
            metadata = {k: sorted(v) if isinstance(v, (set, frozenset)) else v for k, v in metadata.items()}
        self.pipeline_class.save_lora_weights(
            save_directory, transformer_lora_layers=state_dict, transformer_lora_adapter_metadata=metadata,
            weight_name=weight_name,
        )
        follow_umask(os.path.join(save_directory, weight_name))

    def _read_lora(self, input_dir: str, weight_name: str) -> dict:
        cls = self.pipeline_class
        sd = cls.lora_state_dict(input_dir, weight_name=weight_name, use_safetensors=True)
        sd = sd[0] if isinstance(sd, tuple) else sd
        prefix = f"{getattr(cls, 'transformer_name', 'transformer')}."
        return {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
