"""Committed benchmark runs reproduce: the first iterations of committed shapes runs, made again through the harness's
own trainer set-up (``benchmarks/shapes.py``'s ``make_trainer``), give the committed iteration metrics exactly.

One run per layer of the trainers: Flow-GRPO (the policy-gradient layer, tier 2) and DiffusionNFT with CFG (the run
layer, tier 2), at the by-prompt batch layout those runs used. A change to sampling, rewards, advantages, the update
loop or either layer's loss that moves a single bit of the second iteration fails here."""

from __future__ import annotations

import json
import os

import pytest
import torch

from test_benchmark_shapes import ROOT, _load

CASES = [  # (results folder, label, seed)
    ("shapes_tier2_matched", "flow_grpo@0.001", 0),
    ("shapes_tier2_op", "diffusion_nft_cfg@0.001", 0),
]
ITERATIONS = 2
KEYS = ("reward", "reward_std", "advantage_abs", "loss", "grad_norm")


@pytest.mark.slow
@pytest.mark.parametrize("folder,label,seed", CASES, ids=[c[1] for c in CASES])
def test_first_iterations_of_a_committed_run_repeat_exactly(folder, label, seed, tmp_path):
    with open(os.path.join(ROOT, "benchmarks", "results", folder, "results.json"), encoding="utf-8") as f:
        results = json.load(f)
    run = next(r for r in results["runs"] if r["method"] == label and r["seed"] == seed)
    mod = _load()
    torch.set_num_threads(1)
    trainer = mod.make_trainer(label, seed, run["tier"], run["config"] and int(run["config"]["max_steps"]),
                               str(tmp_path))
    assert trainer.config.batch_layout == "by_prompt"  # BASE keeps the committed runs' layout
    for step in range(ITERATIONS):
        metrics = trainer.training_iteration(step)
        trainer.state.global_step = step + 1
        committed = run["iterations"][step]
        got = {k: float(metrics[k]) for k in KEYS if k in committed}
        assert len(got) >= 4
        assert got == {k: committed[k] for k in got}, f"iteration {step + 1} of {folder}/{label} seed {seed}"
