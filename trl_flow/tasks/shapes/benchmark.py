"""Benchmark helpers: fixed evaluation prompt sets and pipeline evaluation on them."""

from __future__ import annotations

import numpy as np

from .grammar import CATEGORIES, DEFAULT_MAX_COUNT, test_prompts, train_prompts
from .model import DEFAULT_GUIDANCE_SCALE, DEFAULT_NUM_INFERENCE_STEPS, generate
from .reward import evaluate


def eval_prompts(
    split: str = "test", per_category: int = 40, seed: int = 0, max_count: int = DEFAULT_MAX_COUNT
) -> tuple[list[str], list[str]]:
    """A fixed evaluation set: ``per_category`` prompts per category drawn (with replacement, seeded) from the
    ``split`` ("train" or "test") prompts. Returns (prompts, categories), category-major."""
    ds = test_prompts(max_count) if split == "test" else train_prompts(max_count)
    rng = np.random.default_rng(seed)
    prompts, categories = [], []
    for cat in CATEGORIES:
        pool = [p for p, c in zip(ds["prompt"], ds["category"]) if c == cat]
        if not pool:
            continue
        prompts += [pool[i] for i in rng.integers(0, len(pool), per_category)]
        categories += [cat] * per_category
    return prompts, categories


def evaluate_pipeline(
    pipe,
    split: str = "test",
    per_category: int = 40,
    seed: int = 0,
    num_inference_steps: int = DEFAULT_NUM_INFERENCE_STEPS,
    guidance_scale: float = DEFAULT_GUIDANCE_SCALE,
) -> dict:
    """Samples the fixed evaluation set of ``split`` with ``pipe`` and returns :func:`reward.evaluate`'s dict
    (strict / partial / cleanliness per category and overall)."""
    prompts, categories = eval_prompts(split, per_category, seed)
    images = generate(pipe, prompts, seed=seed, num_inference_steps=num_inference_steps, guidance_scale=guidance_scale)
    return evaluate(images, prompts, categories)
