"""The shapes benchmark: do the methods' claims hold on a laptop?

Trains trl_flow trainers on a committed tiny SD3 shapes base model under equal budgets (same iterations, same
prompts and group size per iteration), several seeds, and evaluates every ``--eval-every`` iterations with the
ODE sampler on noise never used in training (seed 1234; each image of a repeated prompt has its own draw).

Tiers (``--tier``, ``TIERS``), each its own output folder, all on the noisy-caption base unless ``--base clean``:

* tier 1, one prompt (the CartPole of this task): RL trains on one position prompt and is scored on it;
* tier 2, a fixed set of 8 position prompts, scored on those prompts (the papers' training curves); the
  acceptance tier;
* tier 4 ("tier 2b"), tier 2 on a second, disjoint set of 8 position prompts chosen by a stated rule before any
  run on it (``TIER2B_PROMPTS``: the next 8 of tier 2's order), so that no tier-2 claim rests on one prompt set;
* tier 5, the sparse tier: 8 position prompts on which the base rarely succeeds (ODE strict success in (0, 0.15],
  ``SPARSE_PROMPTS``, chosen by ``sparse_prompts``'s rule from the measured table
  ``benchmarks/results/shapes_sparse_base/per_prompt.json`` before any run on it), trained on the binary
  ``shapes_strict`` reward, so that a good trajectory is rare (where a replay buffer can pay: the replay-share change);
* tier 3, a category (position), scored on held-out prompts RL never trains on: ``val`` (the held-out split of
  the same grammar, ``grammar.val_prompts``: 20% of the train-split prompts) and ``test`` (the stricter
  held-out-pairs split, ``grammar.test_prompts``: object pairs never seen together in any training prompt);
* tier 6, the editing tier (the editing tier): the editing base (a tiny FLUX.1 Kontext pipeline,
  ``shapes.load_edit_base_pipeline``) trained on 8 edit instructions (``TIER6_INSTRUCTIONS``, chosen by
  ``edit_tier_instructions``'s rule from the measured table ``EDIT_BASE_TABLE``: the 4 recolour and 4 move
  train-split instructions on which the base succeeds most often),
  each with ``EDIT_SCENES`` fixed source scenes, on the binary ``shapes_edit`` reward (edit made AND the untouched
  objects kept); scored on fresh scenes of those instructions (``trained``) and of the held-out instructions
  (``held_out``, ``edit.test_instructions``);
* tier 0, the hard track: tier 3 on the clean base with the partial reward (``benchmarks/results/shapes``, where
  no setting learned: docs/history.md, "The signal search").

Tiers 1 and 2 also report ``val`` (does what is learned on the trained prompts carry over?). The score and the
training reward of a tier are stated in ``TIERS``; strict and partial are both reported.
Per evaluation it records strict / partial per category, shape cleanliness (not rewarded: catches reward hacking)
and the exact-kernel KL to the base model along the policy's ODE trajectories; per iteration the rollout reward,
clip / mask fractions and CPU seconds per phase. The search that chose this task and ``BASE`` is in
``docs/history.md``.

Outputs in ``--out``: ``results.json`` (every curve), ``summary.json`` (what a script needs: ``base``, per method
``seeds``, ``final_mean``, ``final_std``, ``steps_to_target`` relative to Flow-GRPO, ``kl_final``, the score's name,
and the acceptance checks), ``table.md``, ``score_vs_step.png``, ``score_vs_cpu.png``, ``score_vs_kl.png``.
Target for steps-to-target: base + ``TARGET_FRACTION`` x Flow-GRPO's mean final gain over the base.

    python benchmarks/shapes.py --quick                                   # smoke run (~1 min), run by the test suite
    python benchmarks/shapes.py --tier 2 --jobs 2                         # the four methods, 3 seeds each
    python benchmarks/shapes.py --tier 2 --jobs 2 --seeds 0 --lrs 5e-4 1e-3 2e-3 4e-3   # learning-rate sweep
    python benchmarks/shapes.py --tier 0 --jobs 2 --methods flow_grpo stepwise           # any subset; runs reused

A run is stored as ``runs/<method>[@<lr>]_seed<seed>.json`` in the tier's folder and reused when present (delete
it after changing the harness); ``runs/`` is not committed: ``results.json`` holds every run of the folder, is read
back into ``runs/`` before anything runs, and every invocation summarises all of the folder's runs (so a run added to
a committed folder keeps the others; ``--quick`` writes to its own folder, ``shapes_quick``). Without ``--lrs`` each
method runs at its swept learning rate for the tier (``SWEPT_LR``, chosen from the committed sweep,
docs/history.md) or ``BASE``'s. Each run's record (:func:`run_record`) says what it ran: ``code`` holds the git
commit, whether tracked files outside benchmarks/results differed from it, the evaluation seed and the machine
(:func:`code_info`); runs committed before that record existed lack it (docs/results.md names the commits that
committed them).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

TARGET_FRACTION = 0.8
KL_NOISE_LEVEL = 0.7  # KL to the base model is measured with the flow_sde kernel at this noise level for every method
EVAL_SEED = 1234

# The tiers. train: what RL trains on (a list of prompts, or "category:<name>" for the train split of a category
# minus val); evals: split name -> what it scores (a list of prompts, or "val:<category>" / "test:<category>")
# and how many images per split; primary / score: the split and the detector score of the tier's result;
# reward: the training reward (shapes_<name> in the reward registry).
TIER1_PROMPTS = ["a red circle to the left of a blue triangle"]
TIER2_PROMPTS = [  # the first 8 RL-train position prompts naming two colours, in md5 order of the prompt text
    "a blue circle below a red circle", "a green circle to the left of a blue triangle",
    "a red circle to the left of a blue triangle", "a red square above a blue circle",
    "a green triangle above a red square", "a blue circle to the left of a red square",
    "a green triangle to the left of a red square", "a green triangle to the right of a red square",
]
# Tier 2's second prompt set (tier 4, "tier 2b"), chosen by rule before any run on it: the next 8 prompts of the same
# order (RL-train position prompts naming two colours, md5 order of the text), disjoint from TIER2_PROMPTS
TIER2B_PROMPTS = [
    "a green square below a blue triangle", "a blue circle above a green circle", "a red square below a green square",
    "a blue circle below a green square", "a blue triangle to the left of a red circle",
    "a green square below a blue circle", "a blue circle below a green circle",
    "a blue triangle to the right of a green square",
]
# The sparse tier (tier 5, the replay-share change), chosen by ``sparse_prompts``'s rule from the base's measured
# per-prompt ODE strict success (scripts/measure_sparse_prompts.py -> SPARSE_BASE_TABLE) before any run on it
SPARSE_BASE_TABLE = "benchmarks/results/shapes_sparse_base/per_prompt.json"
SPARSE_MAX_RATE = 0.15
SPARSE_PROMPTS = [  # measured base ODE strict (of 32 images): 3, 2, 2, 3, 4, 4, 4, 3 successes; mean 0.098
    "a blue square above a blue circle", "a red square to the right of a red triangle",
    "a red circle to the right of a red square", "a blue square to the right of a blue circle",
    "a red square to the right of a red circle", "a blue circle to the right of a red square",
    "a blue circle to the left of a blue square", "a blue triangle above a red circle",
]


def sparse_prompts(rows: list[dict], n: int = 8, max_rate: float = SPARSE_MAX_RATE) -> list[str]:
    """The sparse tier's rule: among the measured RL-train position prompts (``rows``: per_prompt.json's
    ``per_prompt``) outside tier 2's and tier 2b's sets, those whose base ODE strict success ``ode_strict`` is in
    (0, ``max_rate``] (rare, but a success exists to learn from and to replay), the first ``n`` in md5 order of the
    prompt text (the order tiers 2 and 2b were chosen in)."""
    taken = set(TIER2_PROMPTS) | set(TIER2B_PROMPTS)
    pool = [r["prompt"] for r in rows if r["prompt"] not in taken and 0 < r["ode_strict"] <= max_rate]
    if len(pool) < n:
        raise ValueError(f"sparse_prompts: only {len(pool)} prompts have 0 < ode_strict <= {max_rate}; need {n}")
    return sorted(pool, key=lambda p: hashlib.md5(p.encode()).hexdigest())[:n]


# The editing tier (tier 6, the editing tier): instructions chosen by ``edit_tier_instructions``'s rule from the
# editing base's measured per-instruction success (scripts/measure_shapes_edit_base.py -> EDIT_BASE_TABLE) before any
# run on it
EDIT_BASE_TABLE = "benchmarks/results/shapes_edit_base/per_instruction.json"
TIER6_INSTRUCTIONS = [  # measured base strict (of 64 scenes): 0.531, 0.438, 0.359, 0.328, 0.562, 0.547, 0.531, 0.484
    "make the red circle green", "make the green circle red", "make the green square red", "make the red square green",
    "move the green circle left", "move the red square right", "move the green square left",
    "move the blue circle down",
]
EDIT_SCENES = 8  # fixed source scenes per trained instruction (train rows: 8 x 8 = 64, scene seed EDIT_SCENE_SEED)
EDIT_SCENE_SEED = 0

def edit_tier_instructions(rows: list[dict], n_per_kind: int = 4) -> list[str]:
    """The editing tier's rule: of the TRAIN-split instructions in the measured table (``rows``: per_instruction.json's
    ``per_instruction``), the ``n_per_kind`` recolour and the ``n_per_kind`` move instructions with the highest base
    strict success (the base succeeds most rarely on squares and on many moves: 11 of 39 never in 64 scenes, where a
    binary reward gives no signal), ties broken by md5 order of the text; recolour first."""
    out = []
    for kind in ("recolor", "move"):
        pool = [r for r in rows if r["split"] == "train" and r["kind"] == kind]
        pool.sort(key=lambda r: (-r["strict"], hashlib.md5(r["instruction"].encode()).hexdigest()))
        if len(pool) < n_per_kind:
            raise ValueError(f"edit_tier_instructions: only {len(pool)} train {kind} instructions in the table")
        out += [r["instruction"] for r in pool[:n_per_kind]]
    return out


TIERS = {
    0: dict(base="clean", train="category:position",
            evals={"val": ("val:position", 100), "test": ("test:position", 100)},
            primary="val", score="partial", reward="partial", steps=50, eval_every=10),
    1: dict(base="noisy", train=TIER1_PROMPTS, evals={"trained": (TIER1_PROMPTS, 64), "val": ("val:position", 64)},
            primary="trained", score="strict", reward="relation", steps=30, eval_every=5, config="ROLLOUT_16"),
    2: dict(base="noisy", train=TIER2_PROMPTS, evals={"trained": (TIER2_PROMPTS, 128), "val": ("val:position", 64)},
            primary="trained", score="strict", reward="relation", steps=60, eval_every=10, config="ROLLOUT_16"),
    # tier 2 on its second prompt set: every tier-2 claim is measured on both sets (the T' measurement)
    4: dict(base="noisy", train=TIER2B_PROMPTS, evals={"trained": (TIER2B_PROMPTS, 128), "val": ("val:position", 64)},
            primary="trained", score="strict", reward="relation", steps=60, eval_every=10, config="ROLLOUT_16"),
    # the sparse tier: binary reward, base strict <= 0.15 on each trained prompt (docs/benchmarks.md, "The sparse
    # tier")
    5: dict(base="noisy", train=SPARSE_PROMPTS, evals={"trained": (SPARSE_PROMPTS, 128), "val": ("val:position", 64)},
            primary="trained", score="strict", reward="strict", steps=60, eval_every=10, config="ROLLOUT_16"),
    3: dict(base="noisy", train="category:position",
            evals={"val": ("val:position", 100), "test": ("test:position", 100)},
            primary="val", score="strict", reward="relation", steps=50, eval_every=10, config="ROLLOUT_16"),
    # the editing tier: (instruction, source image) rows; evals on fresh scenes ("edit:<instructions>" draws)
    6: dict(base="edit", task="edit", train=TIER6_INSTRUCTIONS,
            evals={"trained": (TIER6_INSTRUCTIONS, 128), "held_out": ("test:edit", 64)},
            primary="trained", score="strict", reward="edit", steps=60, eval_every=10, config="EDIT"),
}
# Tiers 1-3 (pilot, docs/history.md): 16 samples per group and microbatches of 32 without accumulation, i.e.
# 4 optimizer steps per iteration of 8 groups; with BASE's 8 x 8 and one step per iteration Flow-GRPO drifted down.
TIER_CONFIGS = {"ROLLOUT_16": dict(num_generations=16, gradient_accumulation_steps=1),
                # the editing base: sources encoded at the output size (32 x 32), 8 T5 tokens, no guidance (none
                # trained), evaluated at the 10 steps its base rates were measured at
                "EDIT": dict(num_generations=16, gradient_accumulation_steps=1, source_image_size="output",
                             max_sequence_length=8, guidance_scale=1.0, eval_num_inference_steps=10)}
PILOT: dict = {}  # --set KEY=VALUE: over BASE and the tier's config, under a method's own overrides
# Learning rate per (tier, method) chosen by the committed sweep (docs/history.md); others use BASE's.
SWEPT_LR: dict[int, dict[str, float]] = {2: {"flow_grpo": 1e-3, "op_grpo": 1e-3, "flow_dppo": 1e-3}}
SWEPT_LR[4] = SWEPT_LR[2]  # tier 2b takes tier 2's swept rates (not swept again on its prompts)
# Acceptance of tier 2 (the tier-2 acceptance): Flow-GRPO's final score on the trained prompts beats the base by these.
ACCEPT_GAIN, ACCEPT_STDS, ACCEPT_CPU_MIN = 0.15, 3.0, 15.0
# The sparse tier's gain (its base is ~0.10, not tier 2's 0.24): +0.10 doubles the base's success rate (tier 2's +0.15
# is +60% of its base) and is 3-4 binomial standard errors of its 128-image evaluation at these rates (0.027-0.035)
ACCEPT_GAIN_SPARSE = 0.10

# Shared by every method: the equal budget (reference-parity defaults: batch std, detached unconditional branch).
BASE = dict(
    height=32, width=32, num_inference_steps=10, guidance_scale=3.0, max_sequence_length=1,
    num_generations=8, prompts_per_step=8, per_device_train_batch_size=32, gradient_accumulation_steps=2,
    learning_rate=5e-4, clip_range=1e-3, beta=0.0, noise_level=0.7, lora_r=16, lora_alpha=32,
    same_noise_per_group=True, eval_num_inference_steps=20, per_device_eval_batch_size=200, disable_tqdm=True,
    # the layout of every committed run before mixed-prompt batches became the trainers' default; `*_mixed` labels
    # take the default (`mixed`)
    batch_layout="by_prompt",
)

# The trained steps, CFG and weight decay of UniRL's Flow-DPPO recipe (AllSDEScheduler: 3 of the first 5 of 10 steps)
UNIRL_STEPS = dict(sde_steps_mode="random", sde_window_size=3, sde_window_range=5, guidance_scale=1.0,
                   weight_decay=0.0)

# label -> (registered trainer name, trl_flow.registered_trainers(); overrides of its config)
METHODS = {
    "flow_grpo": ("grpo", {}),
    # OP-GRPO in the described form (the replay-share change, OPGRPOConfig's defaults): 25% of the SAMPLES replayed, in
    # groups of at most G // 2 buffered + fresh trajectories; only the late tail regenerated (truncation_fraction 0.1:
    # k_off = 8 of 10, the last of the 9 trained steps). Its ablations: correction (per-step ratio, none), truncation,
    # share.
    "op_grpo": ("op-grpo", {}),
    "op_grpo_per_step": ("op-grpo", {"off_policy_correction": "per_step"}),
    "op_grpo_no_correction": ("op-grpo", {"off_policy_correction": "none"}),
    "op_grpo_no_truncation": ("op-grpo", {"truncation_fraction": 0.0}),
    "op_grpo_share_12": ("op-grpo", {"off_policy_fraction": 0.125}),
    "op_grpo_share_50": ("op-grpo", {"off_policy_fraction": 0.5}),
    # groups of G = 4 (32 samples an iteration on tier 2): the described form at G = 4 (8 of 32 samples replayed, in 4
    # groups of 2 buffered + 2 fresh); Flow-GRPO at G = 4 is its reference
    "flow_grpo_g4": ("grpo", {"num_generations": 4}),
    "op_grpo_g4": ("op-grpo", {"num_generations": 4}),
    # the reading where both descriptions hold (docs/op_grpo.md): G - 1 fresh + 1 buffered in EVERY group, one buffered
    # trajectory per prompt, so 1 / 4 = 25% of the samples are replayed; late truncation (truncation_fraction's 0.1)
    "op_grpo_g4_one": ("op-grpo",
                       {"num_generations": 4, "replay_unit": "group", "off_policy_fraction": 1.0}),
    # OP-GRPO as it was before the replay-share change (the committed results up to then): off_policy_fraction the
    # share of GROUPS replaying one buffered trajectory each, truncation at K // 2 = 5 (sigma 0.71, not late). The
    # committed labels map as: op_grpo -> op_grpo_legacy, op_grpo_per_step -> op_grpo_legacy_per_step,
    # op_grpo_no_correction -> op_grpo_legacy_no_correction, op_grpo_no_truncation -> op_grpo_legacy_no_truncation,
    # op_grpo_share_100 -> op_grpo_legacy_share_100, op_grpo_g4_share_100* -> op_grpo_legacy_g4_share_100* (each with
    # the same @lr; a label without @lr on tier 2 ran at SWEPT_LR's op_grpo rate, 1e-3). Every run's config is in its
    # results.json.
    "op_grpo_legacy": ("op-grpo", {"replay_unit": "group", "truncation_step": 5}),
    "op_grpo_legacy_per_step": ("op-grpo",
                                {"replay_unit": "group", "truncation_step": 5, "off_policy_correction": "per_step"}),
    "op_grpo_legacy_no_correction": ("op-grpo",
                                     {"replay_unit": "group", "truncation_step": 5, "off_policy_correction": "none"}),
    "op_grpo_legacy_no_truncation": ("op-grpo", {"replay_unit": "group", "truncation_step": 10}),
    # every group replays one buffered trajectory: the largest replayed-sample share the old design allowed (1 / G)
    "op_grpo_legacy_share_100": ("op-grpo",
                                 {"replay_unit": "group", "truncation_step": 5, "off_policy_fraction": 1.0}),
    # G = 4 with every group replaying its buffered trajectory: 25% of the samples, with the half-way truncation
    "op_grpo_legacy_g4_share_100": ("op-grpo", {"replay_unit": "group", "truncation_step": 5,
                                                "num_generations": 4, "off_policy_fraction": 1.0}),
    # two ablations of it testing the replay diagnostic (op_replay_advantages.py): the whole buffered trajectory
    # reused (truncation off), and the replayed sample kept out of its group's mean and std
    "op_grpo_legacy_g4_share_100_no_truncation": ("op-grpo",
                                                  {"replay_unit": "group", "num_generations": 4,
                                                   "off_policy_fraction": 1.0, "truncation_step": 10}),
    "op_grpo_legacy_g4_share_100_fresh_baseline": ("op-grpo",
                                                   {"replay_unit": "group", "truncation_step": 5, "num_generations": 4,
                                                    "off_policy_fraction": 1.0, "replay_baseline": "fresh"}),
    # parity ablations of Flow-GRPO (the other two parity defaults held fixed)
    "flow_grpo_exact_kl": ("grpo", {"beta": 0.04, "kl_form": "exact"}),
    "flow_grpo_reference_kl": ("grpo", {"beta": 0.04, "kl_form": "reference"}),
    "flow_grpo_cfg_both": ("grpo", {"guidance_grad": "both"}),
    "flow_grpo_group_std": ("grpo", {"scale_rewards": "group"}),
    # Flow-DPPO (KL-mask trust region, the released code's delta 1e-5) and its controls; beta stays BASE's 0 for all.
    "flow_dppo": ("dppo", {"num_inner_epochs": 2}),
    "flow_dppo_paper_delta": ("dppo", {"num_inner_epochs": 2, "kl_mask_delta": 1e-7}),
    "flow_dppo_1epoch": ("dppo", {"num_inner_epochs": 1}),
    "flow_grpo_2epochs": ("grpo", {"num_inner_epochs": 2}),
    "flow_dppo_symmetric": ("dppo", {"num_inner_epochs": 2, "kl_mask_mode": "symmetric"}),
    "op_grpo_kl_mask": ("op-grpo", {"trust_region": "kl_mask"}),
    # Flow-DPPO as its released code trains (UniRL@1a7b501 sd3_flowdppo.yaml, flowdppo.py) at the tier's G and prompts:
    # 3 random SDE steps among steps 0-4 of 10 (ODE elsewhere, only they trained), CFG 1, weight decay 0, the loss's
    # step-0 std (1 - min(sigma, 0.99)), one pass; BASE's beta 0 and the default delta 1e-5 are the code's already.
    # Not followed: its own-noise-per-sample rollout (BASE shares noise per group). `flow_grpo_unirl_steps` is the
    # matched control: the same trained steps, CFG and weight decay with the ratio clip. Both at BASE's lr unless @lr.
    # Evaluated at CFG 1 as trained (eval_guidance_scale follows guidance_scale), so their base differs from the
    # tier's CFG-3 base: give the pair its own --out (e.g. shapes_tier2_unirl) and --reference flow_grpo_unirl_steps.
    "flow_dppo_unirl": ("dppo", {**UNIRL_STEPS, "kl_mask_first_step": "clamp"}),
    "flow_grpo_unirl_steps": ("grpo", UNIRL_STEPS),
    # Stepwise-Flow-GRPO: its own defaults (flow_sde since the kernel measurement's measurement, shared noise per
    # group, joint normalisation) at the paper's T' = 5 (the default until the T' measurement's measurement, now 2:
    # `stepwise_t2`), so the committed `stepwise@...` runs keep their meaning
    "stepwise": ("stepwise", {"num_substeps": 5}),
    "stepwise_per_step": ("stepwise",
                          {"gain_normalization": "per_step", "num_substeps": 5}),
    "stepwise_t1": ("stepwise", {"num_substeps": 1}),
    # the paper's cheaper estimates (it reports its results robust to T' in {2, 5, 8})
    "stepwise_t2": ("stepwise", {"num_substeps": 2}),
    "stepwise_t3": ("stepwise", {"num_substeps": 3}),
    # the paper's ddim kernel (the default until the kernel measurement's measurement): its early stds are tiny, so its
    # clip binds sooner; with eta 1 and with a 5x wider clip
    "stepwise_ddim": ("stepwise", {"sampler": "ddim", "num_substeps": 5}),
    "stepwise_ddim_eta1": ("stepwise",
                           {"sampler": "ddim", "noise_level": 1.0, "num_substeps": 5}),
    "stepwise_ddim_clip5e-3": ("stepwise",
                               {"sampler": "ddim", "clip_range": 5e-3, "num_substeps": 5}),
    "op_grpo_unclipped_term": ("op-grpo", {"importance_weight_placement": "unclipped_term"}),
    # DiffusionNFT (the DiffusionNFT runs): its own defaults (deterministic `ode` rollout from the old policy, nft_beta
    # 1, decay_type 1, 9 of 10 timesteps), CFG-free in rollout, update and evaluation; each sample its own noise (with
    # a deterministic sampler shared noise would make a group one image). BASE's beta 0 replaces the reference's 1e-4
    # KL weight, as for every method. `_cfg`: the same at BASE's guidance 3.0 (rollout, update and evaluation).
    "diffusion_nft": ("nft", {"guidance_scale": 1.0, "same_noise_per_group": False}),
    "diffusion_nft_cfg": ("nft", {"same_noise_per_group": False}),
}
# Mixed-prompt update batches (the trainers' default `batch_layout`, as the released code shuffles before the
# update) against the by-prompt layout of the committed runs: the same method with only the layout changed.
for _name in ("flow_grpo", "flow_dppo_1epoch", "diffusion_nft_cfg"):
    _trainer, _over = METHODS[_name]
    METHODS[f"{_name}_mixed"] = (_trainer, {**_over, "batch_layout": "mixed"})
# Flow-GRPO-Fast's settings (docs/performance.md): an SDE window of 2 in the first half of the 10 steps (only those
# trained), the ODE prefix before it once per group (BASE shares noise per group), only the trained transitions
# stored, the trained steps of a microbatch in one forward, embeddings cached; mixed-prompt batches, so that
# `flow_grpo_mixed` (the same samples per iteration, every step trained) is its reference.
FAST = {"sde_window_size": 2, "shared_prefix": True, "trajectory_storage": "trained", "batch_replay_steps": True,
        "cache_prompt_embeds": True}
METHODS["flow_grpo_fast_mixed"] = ("grpo", {**FAST, "batch_layout": "mixed"})
DEFAULT_METHODS = ["flow_grpo", "op_grpo"]


# ----------------------------------------------------------------------------------------------- one run
def _category_prompts(split: str, category: str) -> list[str]:
    from trl_flow.tasks.shapes import grammar

    ds = {"val": grammar.val_prompts, "test": grammar.test_prompts}[split]()
    return [p for p, c in zip(ds["prompt"], ds["category"]) if c == category]


def edit_rows(tier: dict, split: str | None = None, scale: float = 1.0) -> dict[str, list]:
    """The editing tier's rows: ``split=None`` the training rows (each trained instruction on ``EDIT_SCENES`` fixed
    scenes, or the tier's ``scenes``: ``--set scenes=N``), else the evaluation split's ``n`` fresh scenes (seed
    ``EVAL_SEED``): ``{"prompt", "source_image"}``."""
    from trl_flow.tasks.shapes import edit

    if split is None:
        scenes = tier.get("scenes", EDIT_SCENES)
        rows = edit.edit_rows(list(tier["train"]), len(tier["train"]) * scenes, EDIT_SCENE_SEED)
    else:
        source, n = tier["evals"][split]
        n = max(1, int(n * scale))
        pool = edit.test_instructions() if source == "test:edit" else list(source)
        if isinstance(source, str) and source != "test:edit":
            raise ValueError(f"editing tier: unknown evaluation source {source!r}")
        rows = edit.edit_rows(pool, n, EVAL_SEED)
    return {"prompt": rows["prompt"], "source_image": rows["source_image"]}


def train_prompts(tier: dict) -> list[str]:
    if isinstance(tier["train"], str):
        from trl_flow.tasks.shapes import grammar

        return list(grammar.rl_train_prompts(categories=(tier["train"].split(":", 1)[1],))["prompt"])
    return list(tier["train"])


def subset_tier(tier: dict, n: int, trained_images: int = 64) -> dict:
    """The tier trained on ``n`` prompts of its category (the first ``n`` in md5 order of the prompt text), scored
    as before plus a ``trained`` split of ``trained_images`` images of those prompts: transfer against prompt-set
    size (``--train-prompts``)."""
    if not isinstance(tier["train"], str):
        raise SystemExit("--train-prompts: the tier trains on a fixed prompt list already; use --tier 3 or 0")
    pool = train_prompts(tier)
    if not 1 <= n <= len(pool):
        raise SystemExit(f"--train-prompts {n}: the tier's category has {len(pool)} training prompts; pick "
                         f"1-{len(pool)}")
    chosen = sorted(pool, key=lambda p: hashlib.md5(p.encode()).hexdigest())[:n]
    return {**tier, "train": chosen, "evals": {"trained": (chosen, trained_images), **tier["evals"]}}


def eval_sets(tier: dict, scale: float = 1.0) -> dict[str, tuple[list[str], list[str]]]:
    """Fixed evaluation prompts per split: a prompt list repeated to ``n`` images, or ``n`` seeded draws (with
    replacement) from the ``val`` / ``test`` prompts of a category."""
    import numpy as np

    from trl_flow.tasks.shapes import grammar

    out = {}
    if tier.get("task") == "edit":  # (instructions, edit kinds, source images) per split
        from trl_flow.tasks.shapes import parse_instruction

        for split in tier["evals"]:
            rows = edit_rows(tier, split, scale)
            out[split] = (rows["prompt"], [parse_instruction(p).kind for p in rows["prompt"]], rows["source_image"])
        return out
    for split, (source, n) in tier["evals"].items():
        n = max(1, int(n * scale))
        if isinstance(source, str):
            which, cat = source.split(":", 1)
            pool = _category_prompts(which, cat)
            rng = np.random.default_rng(EVAL_SEED)
            prompts = [pool[i] for i in rng.integers(0, len(pool), n)]
        else:
            prompts = [source[i % len(source)] for i in range(n)]
        cats = [grammar.parse_prompt(p).category for p in prompts]
        out[split] = (prompts, cats)
    return out


def evaluate(trainer, sets, primary: str, kl_prompts: int = 64) -> dict:
    from trl_flow.tasks import shapes

    t0 = time.process_time()
    out = {}
    with trainer.ema_weights():
        for split, (prompts, cats, *sources) in sets.items():
            if sources:  # an editing tier: each prompt with its source image, scored by the edit detector
                from trl_flow.editing import source_tensor

                images, _ = trainer.generate(prompts, seed=EVAL_SEED, columns={"source_image": sources[0]})
                out[split] = shapes.evaluate_edits(images, prompts, source_tensor(sources[0], *images.shape[-2:]))
            else:
                images, _ = trainer.generate(prompts, seed=EVAL_SEED)
                out[split] = shapes.evaluate(images, prompts, cats)
        prompts, _, *sources = sets[primary]
        k = min(len(prompts), kl_prompts)
        columns = {"source_image": sources[0][:k]} if sources else None
        # one kernel for every method (flow_sde, a = 0.7), so that methods trained with ddim compare
        out["kl"] = float(trainer.kl_to_reference(prompts[:k], seed=EVAL_SEED, sampler="flow_sde",
                                                  noise_level=KL_NOISE_LEVEL, columns=columns).mean())
    out["eval_cpu_s"] = time.process_time() - t0
    return out


def parse_label(label: str) -> tuple[str, float | None]:
    """``method`` or ``method@lr``."""
    method, _, lr = label.partition("@")
    return method, (float(lr) if lr else None)


def run_config(label: str, seed: int, tier_id: int, steps: int, out: str):
    """The trainer config of one run: ``BASE``, then the tier's config, then ``--set``, then the method's own
    overrides, then the learning rate (``method@lr``, else ``SWEPT_LR``, else ``BASE``'s). Returns (config, trainer
    class)."""
    import trl_flow

    tier = TIERS[tier_id]
    method, lr = parse_label(label)
    trainer_name, overrides = METHODS[method]
    tr_cls = trl_flow.get_trainer(trainer_name)
    cfg_cls = tr_cls.config_class
    lr = lr if lr is not None else SWEPT_LR.get(tier_id, {}).get(method, BASE["learning_rate"])
    tier_config = TIER_CONFIGS.get(tier.get("config"), {})
    kwargs = {**BASE, **tier_config, **PILOT, **overrides, "learning_rate": lr, "seed": seed, "max_steps": steps,
              "output_dir": os.path.join(out, "runs", f"{label}_seed{seed}")}
    kwargs = {k: v for k, v in kwargs.items() if k in cfg_cls.__dataclass_fields__}
    return cfg_cls(**kwargs), tr_cls


def machine_info(reps: int = 300) -> dict:
    """What a CPU-second of this machine buys: its CPU model and the process time of a fixed one-thread workload
    (``reps`` tanh(A A^T) products of 256 x 256 float32). Runs of one summary made on machines whose
    ``calibration_s`` differ have CPU columns that cannot be compared; ``summarise`` says so."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    a = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    t0 = time.process_time()
    for _ in range(reps):
        a = torch.tanh(a @ a.T / 16)
    calibration = time.process_time() - t0
    torch.set_num_threads(threads)
    return {"cpu": cpu, "calibration_s": calibration}


def code_info() -> dict:
    """What a run ran, recorded in its record as ``code``: the git commit of this checkout (None outside git), whether
    tracked files outside ``benchmarks/results/`` differ from it (``dirty``, with those files' paths), the evaluation
    seed, and the machine (platform, CPU count, Python and torch versions)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            return None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)benchmarks/results")
    changed = None if status is None else [line[3:] for line in status.splitlines() if line.strip()]
    return {"git_commit": None if commit is None else commit.strip(),
            "dirty": None if changed is None else bool(changed), "dirty_files": changed,
            "eval_seed": EVAL_SEED,
            "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                        "python": platform.python_version(), "torch": torch.__version__}}


def run_record(label: str, seed: int, tier_id: int, base_name: str, config: dict, iters: list[dict],
               evals: list[dict], cpu: float, sheet: str | None = None) -> dict:
    """One run's record, as ``runs/<label>_seed<seed>.json`` and results.json store it: its label, seed, tier, base,
    learning rate, task, trainer config (``config``: the config's ``to_dict()``), per-iteration metrics, evaluations,
    CPU seconds, the machine's CPU calibration (:func:`machine_info`) and the code it ran (:func:`code_info`)."""
    return {"method": label, "seed": seed, "tier": tier_id, "base_model": base_name,
            "learning_rate": config["learning_rate"], "sheet": sheet, "task": _task(TIERS[tier_id]),
            "config": {k: _portable(str(v)) for k, v in config.items()}, "iterations": iters, "evals": evals,
            "cpu_s": cpu, "eval_cpu_s": sum(e["eval_cpu_s"] for e in evals), "machine": machine_info(),
            "code": code_info()}


def make_trainer(label: str, seed: int, tier_id: int, steps: int, out: str, base_name: str | None = None):
    """The trainer of one run: ``run_config``'s config on the tier's base model, reward and training prompts."""
    from trl_flow.rewards import get_reward
    from trl_flow.tasks import shapes

    tier = TIERS[tier_id]
    config, tr_cls = run_config(label, seed, tier_id, steps, out)
    # the registry's shapes_partial / _strict / _dense / _relation / _edit
    reward = get_reward(f"shapes_{tier['reward']}")
    # the editing base (or a pretrain_shapes_edit.py folder) on (instruction, source) rows
    if tier.get("task") == "edit":
        from datasets import Dataset

        if base_name not in (None, "edit") and not os.path.isdir(base_name):
            raise SystemExit(f"--base {base_name}: the editing tier takes 'edit' (the committed editing base) or a "
                             "scripts/pretrain_shapes_edit.py folder")
        base = shapes.load_edit_base_pipeline(path=None if base_name in (None, "edit") else base_name)
        return tr_cls(config, _own_settings_only(base), [reward], train_dataset=Dataset.from_dict(edit_rows(tier)))
    # a committed base (clean, noisy: shapes.BASE_MODEL_VARIANTS) or a save_pretrained folder (pretrain_shapes.py)
    base = shapes.load_base_pipeline(variant=base_name or tier["base"])
    return tr_cls(config, _own_settings_only(base), [reward], train_dataset=train_prompts(tier))


def _own_settings_only(pipe):
    """``pipe`` declaring no sampling settings of its own: the harness sets every one (``BASE``, the tier's config, the
    method's overrides), and a model's ``trl_flow_defaults.json`` would replace a field a method sets to its dataclass
    default (``diffusion_nft``'s and the UniRL labels' guidance_scale 1.0 became the noisy base's 3.0)."""
    from trl_flow.trainers.trl_compat import MODEL_DEFAULTS_ATTR

    setattr(pipe, MODEL_DEFAULTS_ATTR, {})
    return pipe


def run_one(label: str, seed: int, tier_id: int, steps: int, eval_every: int, eval_scale: float, out: str,
            base_name: str | None = None) -> dict:
    tier = TIERS[tier_id]
    base_name = base_name or tier["base"]
    trainer = make_trainer(label, seed, tier_id, steps, out, base_name)
    sets = eval_sets(tier, eval_scale)
    primary, score = tier["primary"], tier["score"]
    evals = [{"step": 0, "cpu_s": 0.0, **evaluate(trainer, sets, primary)}]
    iters, cpu = [], 0.0
    for step in range(steps):
        t0 = time.process_time()
        m = trainer.training_iteration(step)
        trainer.state.global_step = step + 1
        cpu += time.process_time() - t0
        iters.append({"step": step + 1, "cpu_s": cpu, **{k: float(v) for k, v in m.items()}})
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            evals.append({"step": step + 1, "cpu_s": cpu, **evaluate(trainer, sets, primary)})
            e = evals[-1]
            others = " ".join(f"{k} {e[k]['overall'][score]:.3f}" for k in sets if k != primary)
            print(f"[tier {tier_id} {label} seed {seed}] step {step + 1}/{steps} reward {m['reward']:.3f} "
                  f"{primary} {e[primary]['overall'][score]:.3f} {others} kl {e['kl']:.4f} ({cpu:.0f} cpu-s)",
                  flush=True)
    sheet = edit_sheet(trainer, tier, out, label, seed) if tier.get("task") == "edit" else None
    return run_record(label, seed, tier_id, base_name, trainer.config.to_dict(), iters, evals, cpu, sheet)


def edit_sheet(trainer, tier: dict, out: str, label: str, seed: int, per_instruction: int = 2) -> str:
    """The editing tier's before / after sheet of one run: ``per_instruction`` fresh evaluation scenes of each trained
    instruction, columns in instruction order; rows: the source, the base model (LoRA off), the trained model (EMA if
    on), same noise (``EVAL_SEED``), upscaled 4x. Written to ``out/sheets/<label>_seed<seed>.png``; returns its path
    relative to ``out``."""
    from PIL import Image

    from trl_flow.editing import source_tensor
    from trl_flow.hub import before_after
    from trl_flow.video import grid

    rows = edit_rows(tier, "trained")
    picked = [i for ins in tier["train"]
              for i in [j for j, p in enumerate(rows["prompt"]) if p == ins][:per_instruction]]
    prompts = [rows["prompt"][i] for i in picked]
    sources = [rows["source_image"][i] for i in picked]
    pair, has_before = before_after(trainer, prompts, seed=EVAL_SEED, columns={"source_image": sources})
    h, w = pair.size[1] // (2 if has_before else 1), pair.size[0] // len(prompts)
    src = grid(source_tensor(sources, h, w), cols=len(prompts))
    sheet = Image.new("RGB", (pair.size[0], src.size[1] + pair.size[1]))
    sheet.paste(src, (0, 0))
    sheet.paste(pair, (0, src.size[1]))
    sheet = sheet.resize((sheet.size[0] * 4, sheet.size[1] * 4), Image.NEAREST)
    rel = os.path.join("sheets", f"{label}_seed{seed}.png")
    os.makedirs(os.path.join(out, "sheets"), exist_ok=True)
    sheet.save(os.path.join(out, rel))
    return rel


def _task(tier: dict) -> dict:
    return {"train": tier["train"] if isinstance(tier["train"], str) else list(tier["train"]),
            "evals": {k: [v[0] if isinstance(v[0], str) else list(v[0]), v[1]] for k, v in tier["evals"].items()},
            "primary": tier["primary"], "score": tier["score"], "reward": tier["reward"],
            "config": TIER_CONFIGS.get(tier.get("config"), {}),
            # recorded only when not EDIT_SCENES, so runs made before the option share a task with default ones
            **({"scenes": tier["scenes"]} if tier.get("scenes", EDIT_SCENES) != EDIT_SCENES else {})}


# --------------------------------------------------------------------------------------------- summary
def runs_task(runs: list[dict], tier: dict) -> dict:
    """The task the runs were made with (prompts, evals, reward; a ``--set reward=...`` run records its own), not
    the tier's current default. Runs made with different tasks do not share one summary: refused, naming them."""
    tasks = {json.dumps(r["task"], sort_keys=True): r["task"] for r in runs if r.get("task")}
    if len(tasks) > 1:
        names = {k: [f"{r['method']} seed {r['seed']}" for r in runs if json.dumps(r.get("task"), sort_keys=True) == k]
                 for k in tasks}
        raise SystemExit("runs of one --out were made with different tasks (prompts, evals or reward); give each "
                         "task its own --out: " + "; ".join(f"{t['reward']!r} reward: {', '.join(names[k])}"
                                                          for k, t in tasks.items()))
    return next(iter(tasks.values())) if tasks else _task(tier)


def _relation_by_split(runs: list[dict], splits) -> dict:
    """Colour-level relation accuracy (``shapes.evaluate``'s ``relation``) per split, over the runs that recorded it
    (runs made before it was reported did not): ``{split: {"base", "final": (mean, std), "gain_per_seed", "seeds"}}``,
    the base from those runs' step-0 evaluations; {} where none did."""
    out = {}
    for sp in splits:
        rs = [r for r in runs if all("relation" in e[sp]["overall"] for e in r["evals"])]
        if rs:
            first = [r["evals"][0][sp]["overall"]["relation"] for r in rs]
            last = [r["evals"][-1][sp]["overall"]["relation"] for r in rs]
            out[sp] = {"base": statistics.mean(first), "final": _ms(last),
                       "gain_per_seed": [b - a for a, b in zip(first, last)], "seeds": [r["seed"] for r in rs]}
    return out


def _ms(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return None, None
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def _mean_key(rows, key):
    vals = [r[key] for r in rows if key in r and not math.isnan(r[key])]
    return statistics.mean(vals) if vals else None


def _order(label: str):
    method, lr = parse_label(label)
    return (list(METHODS).index(method) if method in METHODS else len(METHODS), lr or 0.0)


def reference_label(labels, tier_id: int, reference: str | None = None) -> str | None:
    """The Flow-GRPO run that targets and ratios are relative to: ``reference`` if given, else ``flow_grpo``, else
    the one ``flow_grpo@lr`` of a sweep folder, else the one at the tier's swept rate; None if none of these."""
    labels = set(labels)
    if reference is not None:
        if reference not in labels:
            raise SystemExit(f"--reference {reference}: no such runs here ({', '.join(sorted(labels))})")
        return reference
    if "flow_grpo" in labels:
        return "flow_grpo"
    swept = [lb for lb in labels if parse_label(lb)[0] == "flow_grpo" and parse_label(lb)[1] is not None]
    if len(swept) == 1:
        return swept[0]
    lr = SWEPT_LR.get(tier_id, {}).get("flow_grpo")
    return next((lb for lb in swept if lr is not None and parse_label(lb)[1] == lr), None)


def summarise(runs: list[dict], tier_id: int, reference: str | None = None) -> dict:
    tier = TIERS[tier_id]
    primary, score = tier["primary"], tier["score"]
    splits = list(tier["evals"])

    def final(run, split=primary, key=score):
        return run["evals"][-1][split]["overall"][key]

    def first_reaching(evals, target, key):
        for e in evals:
            if e[primary]["overall"][score] >= target - 1e-9:
                return e[key]
        return None

    by: dict[str, list[dict]] = {}
    for r in runs:
        by.setdefault(r["method"], []).append(r)
    base = statistics.mean(r["evals"][0][primary]["overall"][score] for r in runs)
    base_clean = statistics.mean(r["evals"][0][primary]["overall"]["cleanliness"] for r in runs)
    ref = reference_label(by, tier_id, reference)
    target = None
    if ref:
        gain = statistics.mean(final(r) for r in by[ref]) - base
        target = base + TARGET_FRACTION * gain if gain > 0 else None
    summary = {"tier": tier_id, "score": f"{score} accuracy on the {primary} split", "score_key": score,
               "split": primary, "base_model": runs[0].get("base_model", tier["base"]), "task": runs_task(runs, tier),
               "base": base, "base_by_split": {sp: {k: statistics.mean(r["evals"][0][sp]["overall"][k] for r in runs)
                                                    for k in ("strict", "partial")} for sp in splits},
               "target": target, "target_fraction": TARGET_FRACTION, "reference": ref, "methods": {}}
    if "test" in splits:
        summary["base_test"] = summary["base_by_split"]["test"][score]
    for m in sorted(by, key=_order):
        rs = by[m]
        finals = [final(r) for r in rs]
        s = {
            "seeds": [r["seed"] for r in rs], "learning_rate": rs[0].get("learning_rate"),
            "final_mean": _ms(finals)[0], "final_std": _ms(finals)[1], "final_per_seed": finals,
            "final_by_split": {sp: {k: _ms([final(r, sp, k) for r in rs]) for k in ("strict", "partial")}
                               for sp in splits},
            "relation_by_split": _relation_by_split(rs, splits),
            "cleanliness_final": _ms([final(r, key="cleanliness") for r in rs]),
            "kl_final": _ms([r["evals"][-1]["kl"] for r in rs])[0],
            "kl_final_ms": _ms([r["evals"][-1]["kl"] for r in rs]),
            "reward_first10": _ms([statistics.mean(i["reward"] for i in r["iterations"][:10]) for r in rs]),
            "reward_last10": _ms([statistics.mean(i["reward"] for i in r["iterations"][-10:]) for r in rs]),
            "clip_frac": _ms([_mean_key(r["iterations"], "clip_frac") for r in rs]),
            "clip_frac_off_policy": _ms([_mean_key(r["iterations"], "clip_frac_off_policy") for r in rs]),
            "clip_frac_weighted_off_policy": _ms([_mean_key(r["iterations"], "clip_frac_weighted_off_policy")
                                                  for r in rs]),
            "mask_frac": _ms([_mean_key(r["iterations"], "mask_frac") for r in rs]),
            "cpu_s_per_iter": _ms([r["cpu_s"] / len(r["iterations"]) for r in rs]),
            "cpu_s_per_run": _ms([r["cpu_s"] + r["eval_cpu_s"] for r in rs]),
            "best_mean": _ms([max(e[primary]["overall"][score] for e in r["evals"]) for r in rs]),
            # each seed's score averaged over its last 3 evaluations: a final gain that is one lucky evaluation
            # shows as a lower window mean
            "last3_mean": _ms([statistics.mean(e[primary]["overall"][score] for e in r["evals"][-3:])
                               for r in rs]),
        }
        # legacy keys of the tier-0 schema
        if "test" in splits:
            s["final_test"] = s["final_by_split"]["test"][score]
        s["final_strict"] = s["final_by_split"][primary]["strict"]
        s.update(steps_to_target=None, cpu_to_target=None, n_reached=0)  # relative to Flow-GRPO; None: no target
        if target is not None:
            s["steps_to_target_per_seed"] = [first_reaching(r["evals"], target, "step") for r in rs]
            s["cpu_to_target_per_seed"] = [first_reaching(r["evals"], target, "cpu_s") for r in rs]
            s["n_reached"] = sum(x is not None for x in s["steps_to_target_per_seed"])
            s["kl_at_target"] = _ms([first_reaching(r["evals"], target, "kl") for r in rs])[0]
        summary["methods"][m] = s
    if target is not None:
        fg = summary["methods"][ref]
        ref_steps = _ms(fg["steps_to_target_per_seed"])[0]
        ref_cpu = _ms(fg["cpu_to_target_per_seed"])[0]
        for s in summary["methods"].values():
            st, ct = _ms(s["steps_to_target_per_seed"])[0], _ms(s["cpu_to_target_per_seed"])[0]
            s["steps_to_target"] = st / ref_steps if st and ref_steps else None
            s["cpu_to_target"] = ct / ref_cpu if ct and ref_cpu else None
    summary["machines"] = [{"run": f"{r['method']} seed {r['seed']}", **r.get("machine", {})} for r in runs]
    cal = [m.get("calibration_s") for m in summary["machines"]]
    known = [c for c in cal if c is not None]
    summary["cpu_comparable"] = (len(known) == len(cal) and max(known) <= 1.25 * min(known)) if known else None
    if ref:
        fg = summary["methods"][ref]
        gain = fg["final_mean"] - base
        need_gain = {1: ACCEPT_GAIN, 2: ACCEPT_GAIN, 4: ACCEPT_GAIN, 5: ACCEPT_GAIN_SPARSE}.get(tier_id, 0.08)
        need_cpu = ACCEPT_CPU_MIN if tier_id in (1, 2, 4, 5) else 25.0
        summary["acceptance"] = {
            "gain": gain, "required_gain": need_gain,
            "gain_ok": gain >= need_gain,
            f"gain_at_least_{need_gain:g}": gain >= need_gain,
            "gain_at_least_3_std": gain >= ACCEPT_STDS * fg["final_std"] and len(fg["seeds"]) >= 3,
            "training_reward_rises": fg["reward_last10"][0] > fg["reward_first10"][0],
            "cleanliness_drop": base_clean - fg["cleanliness_final"][0],
            "cleanliness_ok": base_clean - fg["cleanliness_final"][0] <= 0.01,
            "cpu_s_per_run": fg["cpu_s_per_run"][0], "cpu_minutes_limit": need_cpu,
            "cpu_ok": fg["cpu_s_per_run"][0] <= need_cpu * 60,
        }
    return summary


def table(summary: dict) -> str:
    def f(pair, nd=3):
        if pair is None or pair[0] is None:
            return "n/a"
        return f"{pair[0]:.{nd}f} ± {pair[1]:.{nd}f}"

    def rel(x, n, total):
        return f"{x:.2f}x ({n}/{total} reached)" if x is not None else f"n/a ({n}/{total} reached)"

    t, primary, score = summary.get("target"), summary["split"], summary["score_key"]
    other = "partial" if score == "strict" else "strict"
    splits = list(summary["base_by_split"])
    others = [sp for sp in splits if sp != primary]
    base_txt = ", ".join(f"{sp} {v['strict']:.3f} strict / {v['partial']:.3f} partial"
                         for sp, v in summary["base_by_split"].items())
    lines = [f"Tier {summary['tier']}, base model `{summary['base_model']}`, training reward "
             f"`shapes_{summary['task']['reward']}`. Score: `{score}` on the `{primary}` split (ODE, noise never "
             f"used in training). Base: {base_txt}. Target = base + {TARGET_FRACTION:g} x the mean gain of "
             f"`{summary.get('reference') or 'flow_grpo'}` (the reference of the ratios) = "
             + (f"{t:.3f}." if t is not None else "n/a."), "",
             f"| method | lr | seeds | final {score} ({primary}) | final {other} ({primary}) | "
             + "".join(f"final {score} ({sp}) | " for sp in others)
             + "cleanliness | KL to base | steps-to-target | CPU-to-target | KL at target | clip frac | "
             "off-policy clip frac | mask frac | reward first 10 -> last 10 | CPU s/iter |",
             "|" + "---|" * (15 + len(others))]
    for m, s in summary["methods"].items():
        n = len(s["seeds"])
        fb = s["final_by_split"]
        lr = s.get("learning_rate")
        lines.append(
            f"| {m} | {'n/a' if lr is None else format(lr, 'g')} | {n} | {f((s['final_mean'], s['final_std']))} | "
            f"{f(fb[primary][other])} | " + "".join(f"{f(fb[sp][score])} | " for sp in others)
            + f"{f(s['cleanliness_final'], 4)} | {s['kl_final']:.4f} | "
            f"{rel(s.get('steps_to_target'), s.get('n_reached', 0), n)} | "
            f"{rel(s.get('cpu_to_target'), s.get('n_reached', 0), n)} | "
            f"{'n/a' if s.get('kl_at_target') is None else format(s['kl_at_target'], '.3f')} | {f(s['clip_frac'])} | "
            f"{f(s['clip_frac_off_policy'])} | {f(s['mask_frac'])} | "
            f"{s['reward_first10'][0]:.3f} -> {s['reward_last10'][0]:.3f} | {f(s['cpu_s_per_iter'], 2)} |")
    rel_rows = [(m, sp, v) for m, s in summary["methods"].items() for sp, v in s.get("relation_by_split", {}).items()]
    if rel_rows:
        lines += ["", "Colour-level relation accuracy (shapes ignored; two-colour position prompts), over the runs "
                  "that recorded it: " + "; ".join(f"{m} {sp} {v['base']:.3f} -> {f(v['final'])} (seeds "
                                                   f"{', '.join(map(str, v['seeds']))})" for m, sp, v in rel_rows)
                  + "."]
    if not summary.get("cpu_comparable", True):
        cal = [m["calibration_s"] for m in summary["machines"] if m.get("calibration_s") is not None]
        lines += ["", "CPU columns mix machines: " + (f"calibration {min(cal):.2f}-{max(cal):.2f} s over "
                  f"{len(cal)} runs, " if cal else "") + f"{len(summary['machines']) - len(cal)} runs without a "
                  "machine record (`machines` in summary.json). Compare CPU only between runs of one machine."]
    if "acceptance" in summary:
        a = summary["acceptance"]
        lines += ["", f"Acceptance (Flow-GRPO): gain {a['gain']:+.3f} (>= {a['required_gain']:g}: {a['gain_ok']}; "
                  f">= 3 std: {a['gain_at_least_3_std']}); training reward rises: {a['training_reward_rises']}; "
                  f"cleanliness drop {a['cleanliness_drop']:+.4f} (<= 0.01: {a['cleanliness_ok']}); CPU per run "
                  f"{a['cpu_s_per_run'] / 60:.1f} min (<= {a['cpu_minutes_limit']:g}: {a['cpu_ok']})."]
    return "\n".join(lines) + "\n"


def plot(runs: list[dict], summary: dict, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    primary, score = summary["split"], summary["score_key"]
    labels = sorted({r["method"] for r in runs}, key=_order)
    for xkey, fname, xlabel in (("step", "score_vs_step.png", "iteration"),
                                ("cpu_s", "score_vs_cpu.png", "CPU seconds (one core, training only)"),
                                ("kl", "score_vs_kl.png", "KL to base model")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for i, m in enumerate(labels):
            for j, r in enumerate([r for r in runs if r["method"] == m]):
                xs = [e[xkey] for e in r["evals"]]
                ys = [e[primary]["overall"][score] for e in r["evals"]]
                ax.plot(xs, ys, color=f"C{i % 10}", alpha=0.8, marker=".", label=m if j == 0 else None)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"{score} accuracy ({primary} prompts)")
        ax.set_title(f"shapes tier {summary['tier']}", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(os.path.join(out, fname), dpi=100)
        plt.close(fig)


def canonical_labels(runs: list[dict]) -> list[dict]:
    """One name per configuration: a run labelled ``method`` (no rate) whose learning rate equals that of runs
    labelled ``method@lr`` in the same folder is relabelled ``method@lr`` (``--run-one flow_grpo`` takes the swept
    rate, so it would otherwise be summarised apart from the ``flow_grpo@0.001`` runs it repeats). A folder of bare
    labels only keeps them. Two runs of one label and seed are refused: which one counts would be silent."""
    rated = {parse_label(r["method"]): r["method"] for r in runs if "@" in r["method"]}
    out, seen = [], {}
    for r in runs:
        method, lr = parse_label(r["method"])
        label = rated.get((method, r.get("learning_rate")), r["method"]) if lr is None else r["method"]
        if (label, r["seed"]) in seen:
            raise SystemExit(f"runs {seen[label, r['seed']]!r} and {r['method']!r} are both {label} seed {r['seed']}: "
                             f"delete one of their files from the folder's runs/")
        seen[label, r["seed"]] = r["method"]
        out.append(r if label == r["method"] else {**r, "method": label})
    return out


def _portable(value: str) -> str:
    """A path under ``benchmarks/results/`` as it reads from the repository root; anything else unchanged. Committed
    results never name the machine's folders (``--out`` may be absolute, and a run's ``output_dir`` follows it)."""
    i = value.find("benchmarks/results/")
    return value[i:] if os.path.isabs(value) and i >= 0 else value


def write_outputs(runs, args: dict, out: str, tier_id: int) -> dict:
    args = {k: _portable(v) if isinstance(v, str) else v for k, v in args.items()}
    recorded, runs = runs, canonical_labels(runs)  # results.json keeps each run as recorded (its file's name)
    summary = summarise(runs, tier_id, args.get("reference"))
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"args": args, "base": {**BASE, **PILOT}, "tier": tier_id, "task": summary["task"],
                   "summary": summary, "runs": recorded}, f)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    text = table(summary)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(text)
    plot(runs, summary, out)
    print(text)
    return summary


# ------------------------------------------------------------------------------------------------ main
def _run_file(out, label, seed):
    return os.path.join(out, "runs", f"{label}_seed{seed}.json")


def default_out(tier_id: int) -> str:
    named = {0: "shapes", 4: "shapes_tier2b", 5: "shapes_sparse", 6: "shapes_edit"}
    return f"benchmarks/results/{named.get(tier_id, f'shapes_tier{tier_id}')}"



def apply_set(tier_id: int, pairs: list[str]) -> None:
    """``--set KEY=VALUE`` pairs: a BASE key goes to ``PILOT``; ``reward``, ``config`` and the editing tier's
    ``scenes`` change the tier itself (``TIERS[tier_id]``). A batch's ``results.json`` records its pairs
    (``args.set``), so that the same call makes its runs again (tests/test_committed_runs_reproduce.py)."""
    for kv in pairs:
        key, _, val = kv.partition("=")
        if key in ("reward", "config"):
            TIERS[tier_id] = {**TIERS[tier_id], key: val}
        elif key == "scenes":  # the editing tier's source scenes per trained instruction
            if TIERS[tier_id].get("task") != "edit" or not val.isdigit() or int(val) < 1:
                raise SystemExit(f"--set {kv}: 'scenes' takes a positive integer, on the editing tier (6) only")
            TIERS[tier_id] = {**TIERS[tier_id], "scenes": int(val)}
        elif key not in BASE:
            raise SystemExit(f"--set {kv}: {key!r} is not a BASE key ({', '.join(BASE)}), 'reward', 'config' or "
                             "'scenes' (tier 6)")
        else:
            PILOT[key] = type(BASE[key])(json.loads(val)) if not isinstance(BASE[key], str) else val

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tier", type=int, default=2, choices=sorted(TIERS))
    ap.add_argument("--methods", nargs="+", default=None, choices=list(METHODS),
                    help="default: flow_grpo op_grpo stepwise flow_dppo (tier 0: flow_grpo op_grpo)")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--lrs", nargs="+", type=float, default=None,
                    help="learning-rate sweep: every method at every rate (runs labelled method@lr)")
    ap.add_argument("--steps", type=int, default=None, help="iterations (default: the tier's)")
    ap.add_argument("--eval-every", type=int, default=None, help="default: the tier's")
    ap.add_argument("--eval-scale", type=float, default=1.0, help="scales the tier's evaluation image counts")
    ap.add_argument("--base", default=None, help="base model: a committed variant (clean, noisy) or a save_pretrained "
                                                 "folder (default: the tier's)")
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                    help="override BASE, or the tier's reward / config (reward=dense, config=none), for a pilot; "
                         "give it its own --out")
    ap.add_argument("--train-prompts", type=int, default=None, metavar="N",
                    help="train on N prompts of the tier's category (first N in md5 order), scored on the tier's "
                         "held-out splits plus a 'trained' split of those prompts; give it its own --out")
    ap.add_argument("--jobs", type=int, default=1, help="runs in parallel, one single-threaded process each")
    ap.add_argument("--out", default=None,
                    help="default: benchmarks/results/shapes_tier<N> (0: .../shapes, 4: ..._tier2b, 5: ..._sparse)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 seed, flow_grpo + op_grpo, 3 iterations")
    ap.add_argument("--summarise-only", action="store_true",
                    help="run nothing; rebuild the outputs from every run of --out (its results.json and runs/)")
    ap.add_argument("--reference", default=None,
                    help="the run label targets and ratios are relative to (default: flow_grpo, else a folder's one "
                         "flow_grpo@lr, else the one at the tier's swept rate)")
    ap.add_argument("--run-one", nargs=2, metavar=("METHOD", "SEED"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    apply_set(args.tier, args.set)
    if args.train_prompts:
        TIERS[args.tier] = subset_tier(TIERS[args.tier], args.train_prompts)
    tier = TIERS[args.tier]
    quick_out = os.path.join("benchmarks", "results", "shapes_quick")
    args.out = args.out or (quick_out if args.quick else default_out(args.tier))
    args.steps = args.steps or tier["steps"]
    args.eval_every = args.eval_every or tier["eval_every"]
    if args.methods is None:
        args.methods = (["flow_grpo", "op_grpo"] if args.tier == 0
                        else ["flow_grpo", "op_grpo", "stepwise", "flow_dppo"])
    if args.quick:
        args.methods, args.seeds, args.steps, args.eval_every, args.eval_scale = (
            ["flow_grpo", "op_grpo"], [0], 3, 2, 4 / max(n for _, n in tier["evals"].values()))
        PILOT.update(prompts_per_step=4, num_generations=4, per_device_train_batch_size=16, num_inference_steps=6,
                    eval_num_inference_steps=10)
    os.makedirs(os.path.join(args.out, "runs"), exist_ok=True)
    if os.path.exists(os.path.join(args.out, "results.json")) and not args.run_one:
        restore_runs(args.out)  # runs/ is not committed: the folder's runs come back before any is added
    if args.run_one:
        torch.set_num_threads(1)
        label, seed = args.run_one[0], int(args.run_one[1])
        run = run_one(label, seed, args.tier, args.steps, args.eval_every, args.eval_scale, args.out, args.base)
        _write_run(args.out, run)
        return run
    labels = [m if args.lrs is None else f"{m}@{lr:g}" for m in args.methods for lr in (args.lrs or [None])]
    todo = [(m, s) for s in args.seeds for m in labels]
    if not args.summarise_only:
        missing = [(m, s) for m, s in todo if not os.path.exists(_run_file(args.out, m, s))]
        if missing:  # a new run must share the folder's task, refused here rather than after its compute
            new = {"method": missing[0][0], "seed": missing[0][1], "task": _task(tier)}
            runs_task(folder_runs(args.out) + [new], tier)
        if args.jobs <= 1 or args.quick:
            torch.set_num_threads(1)
            for m, s in missing:
                main([*_passthrough(args), "--run-one", m, str(s)])
        else:
            _run_parallel(missing, args)
    return write_outputs(folder_runs(args.out), {k: v for k, v in vars(args).items() if k != "run_one"}, args.out,
                         args.tier)


def folder_runs(out: str) -> list[dict]:
    """Every run of ``out/runs/`` (one file per run), in file-name order."""
    runs = []
    for name in sorted(os.listdir(os.path.join(out, "runs"))):
        if name.endswith(".json"):
            with open(os.path.join(out, "runs", name)) as f:
                runs.append(json.load(f))
    return runs


def restore_runs(out: str) -> list[str]:
    """Writes each run of ``out/results.json`` that ``out/runs/`` lacks; returns the files written."""
    with open(os.path.join(out, "results.json")) as f:
        runs = json.load(f)["runs"]
    written = []
    for r in runs:
        if not os.path.exists(_run_file(out, r["method"], r["seed"])):
            written.append(_write_run(out, r))
    return written


def _write_run(out: str, run: dict) -> str:
    """Writes one run's file atomically (a kill leaves the old file or none, never half of one); returns its path."""
    path = _run_file(out, run["method"], run["seed"])
    with open(path + ".tmp", "w") as f:
        json.dump(run, f)
    os.replace(path + ".tmp", path)
    return path


def _passthrough(args) -> list[str]:
    out = ["--tier", str(args.tier), "--steps", str(args.steps), "--eval-every", str(args.eval_every),
           "--eval-scale", str(args.eval_scale), "--out", args.out]
    out += ["--base", args.base] if args.base else []
    out += ["--set", *args.set] if args.set else []
    out += ["--train-prompts", str(args.train_prompts)] if args.train_prompts else []
    return out + (["--quick"] if args.quick else [])


def _run_parallel(todo, args) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    running: list[subprocess.Popen] = []
    queue = list(todo)
    failed = []
    while queue or running:
        while queue and len(running) < args.jobs:
            m, s = queue.pop(0)
            cmd = [sys.executable, os.path.abspath(__file__), *_passthrough(args), "--run-one", m, str(s)]
            running.append(subprocess.Popen(cmd, env=env))
        time.sleep(2)
        for p in list(running):
            if p.poll() is not None:
                running.remove(p)
                if p.returncode:
                    failed.append((p.args[-2:], p.returncode))
    if failed:
        raise SystemExit(f"runs failed: {failed}")


if __name__ == "__main__":
    main()
