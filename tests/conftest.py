"""Shared fixtures of the trl_flow test-suite.

Everything runs offline on CPU with the tiny SD3 pipeline of :mod:`trl_flow.testing` (32x32 images, 2 layers).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

# The test machine has 2 shared cores; more than one intra-op thread makes the tiny models ~10x slower there.
torch.set_num_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

PROMPTS = ["a cat", "a red dog", "a blue car", "green sky"]
EDIT_PROMPTS = ["make it red", "add a dog", "green sky", "no car"]
HEIGHT = WIDTH = 32
MAX_SEQ = 16


def source_image(seed: int, size: tuple[int, int] = (WIDTH, HEIGHT)):
    """A random RGB source image for the editing families, ``size`` = (width, height)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


@pytest.fixture
def edit_dataset(tmp_path):
    """An editing dataset: ``EDIT_PROMPTS`` and source-image paths (files written in tmp_path)."""
    from datasets import Dataset

    paths = []
    for i in range(len(EDIT_PROMPTS)):
        paths.append(str(tmp_path / f"src{i}.png"))
        source_image(i).save(paths[-1])
    return Dataset.from_dict({"prompt": EDIT_PROMPTS, "source_image": paths})


@pytest.fixture(autouse=True)
def _hub_offline(monkeypatch):
    """Never touch the network (huggingface_hub reads the flag at import; patch the constant too)."""
    import huggingface_hub.constants as hf_constants

    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True, raising=False)


@pytest.fixture(scope="session")
def base_pipe():
    """A tiny pipeline WITHOUT any adapter. Read-only: never give it to a trainer (the trainer adds a LoRA)."""
    from trl_flow.testing import tiny_sd3_pipeline

    return tiny_sd3_pipeline()


@pytest.fixture
def fresh_pipe():
    """A factory of fresh tiny pipelines (one per trainer; building one takes ~50 ms after the first)."""
    from trl_flow.testing import tiny_sd3_pipeline

    return tiny_sd3_pipeline


def brightness(images, prompts, **kwargs):
    """Mean pixel value of each image (B, 3, H, W) -> (B,)."""
    return images.mean(dim=(1, 2, 3))


def tiny_config(tmp_path, config_class=None, **overrides):
    """A small, fast config on the tiny pipeline (fp32, CPU, 4 steps, 2 prompts x 4 generations)."""
    from trl_flow import FlowGRPOConfig

    config_class = config_class or FlowGRPOConfig
    kwargs = dict(
        output_dir=str(tmp_path / "out"),
        max_steps=2,
        num_generations=4,
        prompts_per_step=2,
        per_device_train_batch_size=4,
        height=HEIGHT,
        width=WIDTH,
        max_sequence_length=MAX_SEQ,
        num_inference_steps=4,
        eval_num_inference_steps=4,
        per_device_eval_batch_size=4,
        guidance_scale=1.0,
        lora_r=4,
        lora_alpha=8,
        learning_rate=1e-3,
        clip_range=5e-2,
        beta=0.0,
        disable_tqdm=True,
    )
    fields = {f.name for f in dataclasses.fields(config_class)}
    kwargs = {k: v for k, v in kwargs.items() if k in fields}  # DiffusionNFT has no clip_range
    kwargs.update(overrides)
    return config_class(**kwargs)


@pytest.fixture
def make_trainer(tmp_path, fresh_pipe):
    """``make_trainer(rewards=..., train_dataset=..., eval_dataset=..., pipe=..., **config_overrides)``: a
    FlowGRPOTrainer on a fresh tiny pipeline with :func:`tiny_config`."""
    from trl_flow import FlowGRPOTrainer

    def _make(rewards=None, train_dataset=None, eval_dataset=None, pipe=None, **overrides):
        overrides.setdefault("output_dir", str(tmp_path / "out"))
        config = tiny_config(tmp_path, **overrides)
        return FlowGRPOTrainer(
            config,
            pipe if pipe is not None else fresh_pipe(),
            rewards if rewards is not None else [brightness],
            train_dataset=train_dataset if train_dataset is not None else list(PROMPTS),
            eval_dataset=eval_dataset,
        )

    return _make


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: runs for tens of seconds or more (subprocesses, several processes, "
                                       "benchmark reruns); `-m 'not slow'` leaves them out")


def velocity_and_input_grad(adapter, transformer, x0, t, embeds, guidance_scale: float, detach_uncond: bool):
    """The guided velocity at ``x0`` and the gradient of a fixed linear functional of it with respect to ``x0``: the
    family tests compare these with the unconditional branch detached or not (``detach_uncond``)."""
    x = x0.clone().requires_grad_(True)
    v = adapter.velocity(transformer, x, t, embeds, guidance_scale, detach_uncond=detach_uncond)
    (v * torch.linspace(-1, 1, v.numel()).view_as(v)).sum().backward()
    return v.detach(), x.grad
