"""Bring a TRL ``DDPOTrainer`` setup (removed in TRL 0.24) to trl_flow: its reward and prompt functions.

DDPO's reward is ``reward_fn(images, prompts, prompt_metadata) -> (rewards, reward_metadata)`` with images a
float tensor (B, 3, H, W) in [0, 1], ``prompts`` a tuple of B strings and ``prompt_metadata`` a tuple of B dicts
(what its ``prompt_fn() -> (prompt, metadata)`` returned). trl_flow's reward is ``reward(images, prompts,
**columns) -> list[float | None]``: :func:`from_ddpo_reward` wraps the first as the second, and
:func:`prompts_from_ddpo_prompt_fn` turns a ``prompt_fn`` into the prompt dataset, with each prompt's metadata in
a ``prompt_metadata`` column that the wrapped reward hands back to the DDPO function unchanged.

    trainer = FlowGRPOTrainer(config, pipe, [from_ddpo_reward(aesthetic_score)],
                              train_dataset=prompts_from_ddpo_prompt_fn(prompt_fn, num_prompts=1000))

See docs/migrating_from_ddpo.md for DDPOConfig's fields and the script.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable

import torch

METADATA_COLUMN = "prompt_metadata"


def from_ddpo_reward(reward_fn: Callable, name: str | None = None):
    """A trl_flow reward calling the DDPO-style ``reward_fn(images, prompts, prompt_metadata)``.

    ``prompt_metadata``: the per-prompt dicts of a ``prompt_metadata`` column (see
    :func:`prompts_from_ddpo_prompt_fn`; JSON strings are decoded), else one dict per sample of the dataset's other
    columns. The DDPO ``reward_metadata`` (second return value) is discarded; the rewards may be a tensor, an
    array or a list of B numbers. Logged under ``name`` (default: the function's name)."""
    if not callable(reward_fn):
        raise TypeError(f"from_ddpo_reward: {reward_fn!r} is not callable")

    @functools.wraps(reward_fn)
    def reward(images: torch.Tensor, prompts: list[str], **columns) -> list[float]:
        n = len(prompts)
        if METADATA_COLUMN in columns:
            metadata = tuple(json.loads(m) if isinstance(m, str) else (m or {}) for m in columns[METADATA_COLUMN])
        else:
            metadata = tuple({k: v[i] for k, v in columns.items()} for i in range(n))
        out = reward_fn(images, tuple(prompts), metadata)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(f"{reward.__name__}: a DDPO reward returns (rewards, reward_metadata), got "
                            f"{type(out).__name__}; for a function returning rewards only, pass it directly")
        rewards = out[0]
        if isinstance(rewards, torch.Tensor):
            rewards = rewards.detach().float().cpu()
        return [None if r is None else float(r) for r in list(rewards)]

    if name is not None:
        reward.__name__ = name
    return reward


def prompts_from_ddpo_prompt_fn(prompt_fn: Callable, num_prompts: int):
    """A prompt ``datasets.Dataset`` from ``num_prompts`` calls of a DDPO ``prompt_fn() -> (prompt, metadata)``.

    Columns: ``prompt`` and ``prompt_metadata`` (each metadata dict as a JSON string, so any structure round-trips).
    DDPO drew a fresh prompt per image; trl_flow samples ``num_generations`` images per prompt and compares them,
    so draw as many prompts as the run needs distinct prompts (duplicates are fine)."""
    from datasets import Dataset

    if not (isinstance(num_prompts, int) and num_prompts >= 1):
        raise ValueError(f"num_prompts={num_prompts!r}: must be an integer >= 1")
    prompts, metadata = [], []
    for i in range(num_prompts):
        out = prompt_fn()
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], str)):
            raise TypeError(f"prompt_fn: call {i} returned {out!r}; a DDPO prompt_fn returns (prompt, metadata)")
        prompts.append(out[0])
        metadata.append(json.dumps(out[1] if out[1] is not None else {}))
    return Dataset.from_dict({"prompt": prompts, METADATA_COLUMN: metadata})
