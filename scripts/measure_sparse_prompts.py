#!/usr/bin/env python
"""Measures the tier-2 base's strict success per RL-train position prompt: the table the sparse tier's prompts are
chosen from (``benchmarks/shapes.py``, ``SPARSE_PROMPTS`` and ``sparse_prompts``; docs/benchmarks.md, "The sparse
tier").

    nice -n 19 python scripts/measure_sparse_prompts.py          # ~8 CPU-min, one thread
    # -> benchmarks/results/shapes_sparse_base/per_prompt.json

For each of the 164 RL-train position prompts (``train_prompts(TIERS[3])``), on the noisy-caption base (the tier-2
base), with the benchmark's trainer config (``BASE`` + ``ROLLOUT_16``, through ``make_trainer``):

1. ``ode_*``: the benchmark's evaluation sampler: ``trainer.generate`` (ODE, ``eval_num_inference_steps`` = 20,
   guidance 3), noise seed ``EVAL_SEED``, ``--images`` images per prompt (prompt-major; each image its own draw);
2. ``rollout_*``: what RL sees: ``trainer.sample`` with the training kernel (flow_sde, noise level 0.7,
   ``num_inference_steps`` = 10, guidance 3), ``--rollouts`` samples per prompt, each with its own initial noise and
   SDE noise (seeded; never the training run's draws).

Per prompt: strict success rate and count, partial mean, for both samplers, and the prompt's md5 (the order the
selection rule walks).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(ROOT, "benchmarks", "results", "shapes_sparse_base", "per_prompt.json")
ROLLOUT_SEED = 4321  # initial noise of the rollout measurement (training draws its own from (seed, step))


def _bench():
    spec = importlib.util.spec_from_file_location("bench_shapes_measure",
                                                  os.path.join(ROOT, "benchmarks", "shapes.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _scores(images, prompts) -> list[dict]:
    from trl_flow.tasks.shapes import reward

    return [reward.score(img, p) for img, p in zip(images, prompts)]


def _per_prompt(prompts: list[str], rows: list[dict], n: int) -> dict[str, dict]:
    out = {}
    for i, p in enumerate(prompts):
        chunk = rows[i * n : (i + 1) * n]
        wins = int(sum(r["strict"] for r in chunk))
        out[p] = {"successes": wins, "n": n, "strict": wins / n, "partial": sum(r["partial"] for r in chunk) / n}
    return out


def measure_ode(trainer, prompts: list[str], n: int, seed: int, chunk: int = 25) -> dict[str, dict]:
    """The evaluation sampler's per-prompt scores: ``n`` images per prompt, noise seeded by ``seed`` per chunk of
    ``chunk`` prompts (so a chunk's images do not depend on the others)."""
    rows = []
    for lo in range(0, len(prompts), chunk):
        batch = [p for p in prompts[lo : lo + chunk] for _ in range(n)]
        images, _ = trainer.generate(batch, seed=seed + lo)
        rows += _scores(images, batch)
    return _per_prompt(prompts, rows, n)


@torch.no_grad()
def measure_rollouts(trainer, prompts: list[str], n: int, seed: int, chunk: int = 16) -> dict[str, dict]:
    """The training kernel's per-prompt scores: ``n`` trajectories per prompt, independent initial and SDE noise."""
    cfg = trainer.config
    rows = []
    for lo in range(0, len(prompts), chunk):
        ps = prompts[lo : lo + chunk]
        batch = [p for p in ps for _ in range(n)]
        gen = torch.Generator().manual_seed(seed + lo)
        noise = trainer.adapter.initial_noise(len(batch), cfg.height, cfg.width, gen)
        group_ids = torch.arange(len(ps)).repeat_interleave(n)
        rollout = trainer.sample(batch, {}, group_ids, step=seed + lo, noise=noise,
                                 generator_purpose="measure_sparse", sample_ids=torch.arange(len(batch)))
        rows += _scores(trainer.decode(rollout.states[:, -1]), batch)
    return _per_prompt(prompts, rows, n)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=32, help="ODE evaluation images per prompt")
    ap.add_argument("--rollouts", type=int, default=16, help="training-kernel samples per prompt (0: skip)")
    ap.add_argument("--limit", type=int, default=None, help="only the first N prompts (a smoke run)")
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    if args.images < 1 or args.rollouts < 0:
        raise SystemExit(f"--images {args.images} / --rollouts {args.rollouts}: need --images >= 1, --rollouts >= 0")
    torch.set_num_threads(1)
    bench = _bench()
    tier = bench.TIERS[3]
    prompts = bench.train_prompts(tier)[: args.limit]
    t0 = time.process_time()
    with tempfile.TemporaryDirectory() as tmp:
        trainer = bench.make_trainer("flow_grpo", 0, 3, 1, tmp)
        cfg = trainer.config
        ode = measure_ode(trainer, prompts, args.images, bench.EVAL_SEED)
        sde = measure_rollouts(trainer, prompts, args.rollouts, ROLLOUT_SEED) if args.rollouts else {}
    rows = []
    for p in prompts:
        row = {"prompt": p, "md5": hashlib.md5(p.encode()).hexdigest(),
               **{f"ode_{k}": v for k, v in ode[p].items()}}
        if p in sde:
            row.update({f"rollout_{k}": v for k, v in sde[p].items()})
        rows.append(row)
    result = {
        "what": "strict success per RL-train position prompt (train_prompts(TIERS[3])) of the tier-2 base",
        "script": "scripts/measure_sparse_prompts.py", "base": tier["base"],
        "ode": {"sampler": "ode", "num_inference_steps": cfg.eval_num_inference_steps,
                "guidance_scale": cfg.guidance_scale, "seed": bench.EVAL_SEED, "images_per_prompt": args.images},
        "rollout": {"sampler": cfg.sampler, "noise_level": cfg.noise_level,
                    "num_inference_steps": cfg.num_inference_steps, "guidance_scale": cfg.guidance_scale,
                    "seed": ROLLOUT_SEED, "samples_per_prompt": args.rollouts},
        "overall": {"ode_strict": sum(r["ode_strict"] for r in rows) / len(rows),
                    **({"rollout_strict": sum(r["rollout_strict"] for r in rows) / len(rows)} if sde else {})},
        "cpu_s": time.process_time() - t0, "per_prompt": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(args.out + ".tmp", args.out)
    print(json.dumps({k: result[k] for k in ("overall", "cpu_s")}))
    return result


if __name__ == "__main__":
    main()
