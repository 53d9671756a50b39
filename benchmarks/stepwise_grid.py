"""How well Stepwise-Flow-GRPO's intermediate reward predicts the outcome, per substep grid and T'
(the T' measurement).

The intermediate reward r_k scores a clean-image estimate of the state x_k made by T' deterministic Euler steps
from sigma_k to 0. Today's grid is linear in sigma (``substep_sigmas``): from the first state that is one substep
sigma 1 -> 0.8 at T' = 5, 1 -> 0.5 at T' = 2. The suspect (the T' measurement): the rollout's own shifted schedule
(sigma = s t / (1 + (s - 1) t), linear in t, s the scheduler's shift) takes smaller steps where the noise is high and
might give a better estimate at the same cost. Both grids cost the same T' - 1 transformer calls per state.

On rollouts of the tier-2 set-A setting (noisy base, 8 prompts x 16 images, flow_sde, K = 10, shared noise per
group, the untrained policy), for each grid and T' it scores the estimate of every trained state and reports:

* ``corr_final``: Pearson correlation of r_k with the trajectory's final reward r_K, mean over the trained steps;
* ``corr_within``: the same after subtracting each group's mean at that step (what group-relative advantages see);
* ``gain_corr``: correlation of the per-step gains g_k = r_{k+1} - r_k with the later change r_K - r_k (a gain
  should announce where the outcome is decided);
* ``agree_ref``: share of (sample, step) estimates whose binary-rounded reward equals a T' = 20 estimate on the
  same grid.

    python benchmarks/stepwise_grid.py --seed 0 --out benchmarks/results/stepwise_grid_seed0.json   # ~8 CPU-min

``paired``: shifted minus linear at each T', mean over the (iteration, state) units with its standard error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def shifted_grid(sigma: torch.Tensor, num_substeps: int, shift: float) -> torch.Tensor:
    """(B,) start levels -> (B, T' + 1): linear in t from t(sigma) to 0, mapped by sigma = s t / (1 + (s - 1) t)."""
    s = float(shift)
    t0 = sigma.float() / (s - (s - 1.0) * sigma.float())
    frac = torch.linspace(1.0, 0.0, num_substeps + 1, device=sigma.device, dtype=torch.float32)
    t = t0[:, None] * frac[None, :]
    grid = s * t / (1.0 + (s - 1.0) * t)
    grid[:, 0] = sigma.float()
    grid[:, -1] = 0.0
    return grid


def pearson(a: torch.Tensor, b: torch.Tensor) -> float | None:
    a, b = a.double() - a.double().mean(), b.double() - b.double().mean()
    den = (a.norm() * b.norm()).item()
    return None if den == 0 or den != den else float((a * b).sum() / den)


def mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def main(argv=None):
    import shapes as bench  # benchmarks/shapes.py

    from trl_flow.trainers import stepwise_flow_grpo_trainer as sw
    from trl_flow.trainers.base_trainer import FlowRLTrainer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=2, help="rollouts of 8 prompts x 16 images")
    ap.add_argument("--substeps", type=int, nargs="+", default=[2, 3, 5])
    ap.add_argument("--ref-substeps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                   "stepwise_grid.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t_start = time.process_time()
    import tempfile

    trainer = bench.make_trainer("stepwise_t2@0.001", args.seed, 2, args.iterations, tempfile.mkdtemp())
    shift = float(trainer.pipe.scheduler.config.shift)
    linear = sw.substep_sigmas
    grids = {"linear": linear, "shifted": lambda sigma, n: shifted_grid(sigma, n, shift)}
    rows = {}
    for it in range(args.iterations):
        rollout = FlowRLTrainer.make_rollout(trainer, it)  # no intermediate rewards: each grid computes its own
        K = rollout.schedule.num_steps
        steps = trainer.estimated_steps(rollout)  # the states the trainer scores: k and k + 1 of each trained k
        trained = rollout.trained_steps()
        n = len(rollout)
        final = rollout.rewards.float().cpu()
        gids = rollout.group_ids.cpu()
        for gname, fn in grids.items():
            for T in [*args.substeps, args.ref_substeps]:
                sw.substep_sigmas = fn
                trainer.config.num_substeps = T
                r = torch.full((n, K + 1), float("nan"))
                r[:, K] = final
                bs = trainer.config.per_device_eval_batch_size
                for k in steps:
                    for lo in range(0, n, bs):
                        idx = torch.arange(lo, min(lo + bs, n))
                        lat = trainer.clean_estimate(rollout, idx, torch.full_like(idx, k))
                        imgs = trainer.decode(lat, bs)
                        rr, _ = trainer.reward(imgs, [rollout.prompts[i] for i in idx.tolist()],
                                               {c: [v[i] for i in idx.tolist()] for c, v in rollout.columns.items()})
                        r[idx, k] = rr.float()
                rows.setdefault((gname, T), []).append((r, final, gids, steps, trained))
        sw.substep_sigmas = linear
    out = {"setting": "tier 2 set A, noisy base, untrained policy, flow_sde K=10, 8 prompts x 16, shared noise",
           "shift": shift, "iterations": args.iterations, "seed": args.seed, "ref_substeps": args.ref_substeps,
           "grid_from_sigma_1": {g: [round(float(x), 4) for x in fn(torch.tensor([1.0]), 5)[0]]
                                 for g, fn in grids.items()},
           "rows": []}
    for (gname, T), runs in rows.items():
        cf, cw, gc, ag = [], [], [], []
        for j, (r, final, gids, steps, trained) in enumerate(runs):
            ref = rows[(gname, args.ref_substeps)][j][0]
            for k in steps:
                cf.append(pearson(r[:, k], final))
                centred = r[:, k].clone()
                fc = final.clone()
                for g in gids.unique():
                    m = gids == g
                    centred[m] -= centred[m].mean()
                    fc[m] -= fc[m].mean()
                cw.append(pearson(centred, fc))
                if k in trained:
                    gc.append(pearson(r[:, k + 1] - r[:, k], final - r[:, k]))
                ag.append(float(((r[:, k] > 0.5) == (ref[:, k] > 0.5)).float().mean()))
        out["rows"].append({"grid": gname, "substeps": T, "corr_final": mean(cf), "corr_within": mean(cw),
                            "gain_corr": mean(gc), "agree_ref": mean(ag),
                            "per_unit": {"corr_final": cf, "corr_within": cw, "gain_corr": gc},
                            "mean_r_first_state": float(torch.stack([x[0][:, x[3][0]] for x in runs]).mean())})
    # shifted - linear at each T', paired over the (iteration, state) units: mean and its standard error
    out["paired"] = []
    by = {(r["grid"], r["substeps"]): r["per_unit"] for r in out["rows"]}
    for T in args.substeps:
        row = {"substeps": T}
        for metric in ("corr_final", "corr_within", "gain_corr"):
            d = [a - b for a, b in zip(by[("shifted", T)][metric], by[("linear", T)][metric])
                 if a is not None and b is not None]
            m = sum(d) / len(d)
            se = (sum((x - m) ** 2 for x in d) / (len(d) - 1) / len(d)) ** 0.5 if len(d) > 1 else None
            row[metric] = {"diff": m, "se": se, "n": len(d)}
        out["paired"].append(row)
    out["cpu_s"] = time.process_time() - t_start
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    for row in out["rows"]:
        print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                       for k, v in row.items() if k != "per_unit"))
    for row in out["paired"]:
        print(f"T'={row['substeps']} shifted - linear: " + ", ".join(
            f"{k} {v['diff']:+.3f} +- {v['se']:.3f}" for k, v in row.items() if k != "substeps"))
    print(f"wrote {args.out} ({out['cpu_s']:.0f} CPU-s)")


if __name__ == "__main__":
    main()
