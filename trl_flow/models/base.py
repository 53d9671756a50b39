"""The small interface a trainer needs from a diffusers pipeline.

An adapter wraps one pipeline family (SD3, later FLUX and Wan) and exposes exactly five operations: encode
prompts, build the sigma schedule, draw initial noise, predict the (guided) velocity, decode latents. It uses the
pipeline's own components and methods, so whatever ``pipe()`` does, the trainer does too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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


class FlowAdapter:
    """Base class of the pipeline adapters. Subclasses implement the methods below."""

    #: LoRA target modules used when the config gives none.
    default_lora_target_modules: tuple[str, ...] = ()
    #: The diffusers pipeline class whose ``save_lora_weights`` writes the adapter.
    pipeline_class = None

    def __init__(self, pipe):
        self.pipe = pipe

    @property
    def transformer(self) -> torch.nn.Module:
        return self.pipe.transformer

    @property
    def device(self) -> torch.device:
        return self.transformer.device

    def encode_prompts(self, prompts: list[str], guidance: bool, max_sequence_length: int) -> PromptEmbeds:
        raise NotImplementedError

    def schedule(self, num_inference_steps: int, height: int, width: int) -> Schedule:
        raise NotImplementedError

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        raise NotImplementedError

    def initial_noise(self, n: int, height: int, width: int, generator: torch.Generator) -> torch.Tensor:
        """(n, *latent_shape) float32 standard normal noise drawn with ``generator`` (on its device)."""
        shape = (n, *self.latent_shape(height, width))
        return torch.randn(shape, generator=generator, device=generator.device, dtype=torch.float32)

    def velocity(self, model, x, timestep, embeds: PromptEmbeds, guidance_scale: float,
                 detach_uncond: bool = False) -> torch.Tensor:
        """Guided velocity (B, *latent_shape) float32 of ``model`` at states ``x`` and a 0-d/(B,) ``timestep``.

        ``detach_uncond``: with classifier-free guidance, detach the unconditional prediction (same value, no
        gradient through that branch; ``guidance_grad="cond_only"``)."""
        raise NotImplementedError

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Images (B, 3, H, W) float32 in [0, 1] from latents (B, *latent_shape)."""
        raise NotImplementedError

    def save_lora_weights(self, save_directory: str, state_dict: dict, metadata: dict | None) -> None:
        raise NotImplementedError
