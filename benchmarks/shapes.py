"""The shapes benchmark: do the methods' claims hold on a laptop?

Runs trl_flow trainers on the committed tiny SD3 shapes base model under equal budgets (same iterations, same
prompts per iteration, same group size), several seeds, evaluating every N iterations on the held-out test prompts
with the ODE sampler. Records per evaluation: strict / partial score per category, shape cleanliness (not
rewarded: catches reward hacking), KL to the base model (exact kernel KL of the training SDE kernel along the
policy's ODE eval trajectories, summed over steps; ``FlowRLTrainer.kl_to_reference``), and per iteration: reward,
clip / mask fractions, wall-clock per phase (rollout incl. decode, reward, update).

Writes ``results.json``, ``score_vs_step.png``, ``score_vs_time.png``, ``score_vs_kl.png`` and ``table.md``
into ``--out``. The table reports final score mean +- std over seeds, steps-to-target and wall-clock-to-target
relative to Flow-GRPO (target = Flow-GRPO's mean final eval score) and KL at the first evaluation reaching the
target.

    python benchmarks/shapes.py --quick                     # smoke run (< 3 min), also run by the test suite
    python benchmarks/shapes.py --out benchmarks/results/shapes   # the full run (about an hour here)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

import torch

import trl_flow
from trl_flow.tasks import shapes

# Shared by every method: the equal budget.
BASE = dict(
    height=32, width=32, num_inference_steps=10, guidance_scale=shapes.DEFAULT_GUIDANCE_SCALE,
    max_sequence_length=shapes.MAX_SEQUENCE_LENGTH, num_generations=8, prompts_per_step=8,
    per_device_train_batch_size=32, gradient_accumulation_steps=2, learning_rate=5e-4, clip_range=1e-3,
    beta=0.0, noise_level=0.7, lora_r=16, lora_alpha=32, eval_num_inference_steps=shapes.DEFAULT_NUM_INFERENCE_STEPS,
    per_device_eval_batch_size=200, disable_tqdm=True, same_noise_per_group=False,
)

# name -> (config class, trainer class, overrides)
METHODS = {
    "flow_grpo": ("FlowGRPOConfig", "FlowGRPOTrainer", {}),
    "op_grpo": ("OPGRPOConfig", "OPGRPOTrainer", {}),
    "op_grpo_per_step": ("OPGRPOConfig", "OPGRPOTrainer", {"off_policy_correction": "per_step"}),
    "op_grpo_no_correction": ("OPGRPOConfig", "OPGRPOTrainer", {"off_policy_correction": "none"}),
    "op_grpo_no_truncation": ("OPGRPOConfig", "OPGRPOTrainer", {"truncation_step": 10}),
    "op_grpo_share_12": ("OPGRPOConfig", "OPGRPOTrainer", {"off_policy_fraction": 0.125}),
    "op_grpo_share_50": ("OPGRPOConfig", "OPGRPOTrainer", {"off_policy_fraction": 0.5}),
    # Flow-DPPO (KL-mask trust region, paper delta 1e-7 for flow_sde) and its controls; beta stays BASE's 0 for all.
    "flow_dppo": ("FlowDPPOConfig", "FlowDPPOTrainer", {"num_inner_epochs": 2}),
    "flow_dppo_1epoch": ("FlowDPPOConfig", "FlowDPPOTrainer", {"num_inner_epochs": 1}),
    "flow_grpo_2epochs": ("FlowGRPOConfig", "FlowGRPOTrainer", {"num_inner_epochs": 2}),
    "flow_dppo_symmetric": ("FlowDPPOConfig", "FlowDPPOTrainer", {"num_inner_epochs": 2, "kl_mask_mode": "symmetric"}),
    "op_grpo_kl_mask": ("OPGRPOConfig", "OPGRPOTrainer", {"trust_region": "kl_mask"}),
    # Stepwise-Flow-GRPO: its own defaults (ddim, eta = noise_level, shared noise per group, T' = 5, joint)
    "stepwise": ("StepwiseFlowGRPOConfig", "StepwiseFlowGRPOTrainer", {"same_noise_per_group": True}),
    "stepwise_per_step": ("StepwiseFlowGRPOConfig", "StepwiseFlowGRPOTrainer",
                          {"same_noise_per_group": True, "gain_normalization": "per_step"}),
    "stepwise_t1": ("StepwiseFlowGRPOConfig", "StepwiseFlowGRPOTrainer",
                    {"same_noise_per_group": True, "num_substeps": 1}),
}
SCORE = "partial"  # the rewarded quantity; strict is reported too


def evaluate(trainer, prompts, categories, seed: int, train_prompts=None) -> dict:
    """Test-prompt scores (the benchmark's measure), KL to the base model, and train-prompt scores (to tell
    'does not learn' from 'does not generalise')."""
    t0 = time.perf_counter()
    with trainer.ema_weights():
        images, _ = trainer.generate(prompts, seed=seed)
        kl = trainer.kl_to_reference(prompts[: min(len(prompts), 64)], seed=seed)
        out = {"scores": shapes.evaluate(images, prompts, categories), "kl": float(kl.mean())}
        if train_prompts is not None:
            tr_images, _ = trainer.generate(train_prompts[0], seed=seed)
            out["train_scores"] = shapes.evaluate(tr_images, *train_prompts)
    out["eval_s"] = time.perf_counter() - t0
    return out


def run_one(method: str, seed: int, steps: int, eval_every: int, per_category: int, out: str) -> dict:
    cfg_name, tr_name, overrides = METHODS[method]
    cfg_cls, tr_cls = getattr(trl_flow, cfg_name), getattr(trl_flow, tr_name)
    kwargs = {**BASE, **overrides, "seed": seed, "max_steps": steps,
              "output_dir": os.path.join(out, "runs", f"{method}_seed{seed}")}
    if cfg_name == "FlowGRPOConfig":
        kwargs = {k: v for k, v in kwargs.items() if k in cfg_cls.__dataclass_fields__}
    config = cfg_cls(**kwargs)
    pipe = shapes.load_base_pipeline()
    trainer = tr_cls(config, pipe, [shapes.shapes_partial_reward], train_dataset=shapes.train_prompts())
    prompts, categories = shapes.benchmark.eval_prompts("test", per_category=per_category, seed=1234)
    train_eval = shapes.benchmark.eval_prompts("train", per_category=per_category, seed=1234)
    evals = [{"step": 0, "wall_s": 0.0, **evaluate(trainer, prompts, categories, seed=1234, train_prompts=train_eval)}]
    iters, wall = [], 0.0
    for step in range(steps):
        t0 = time.perf_counter()
        m = trainer.training_iteration(step)
        trainer.state.global_step = step + 1
        wall += time.perf_counter() - t0
        iters.append({"step": step + 1, "wall_s": wall, **{k: float(v) for k, v in m.items()}})
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            evals.append({"step": step + 1, "wall_s": wall,
                          **evaluate(trainer, prompts, categories, seed=1234, train_prompts=train_eval)})
        print(f"[{method} seed {seed}] step {step + 1}/{steps} reward {m['reward']:.3f} "
              f"eval {evals[-1]['scores']['overall'][SCORE]:.3f} ({wall:.0f}s)", flush=True)
    return {"method": method, "seed": seed, "config": {k: str(v) for k, v in config.to_dict().items()},
            "iterations": iters, "evals": evals}


def _first_reaching(evals, target, key):
    for e in evals:
        if e["scores"]["overall"][SCORE] >= target - 1e-9:
            return e[key]
    return None


def summarise(runs: list[dict]) -> tuple[dict, str]:
    by = {}
    for r in runs:
        by.setdefault(r["method"], []).append(r)
    finals = {m: [rs_["evals"][-1]["scores"]["overall"][SCORE] for rs_ in rs] for m, rs in by.items()}
    target = statistics.mean(finals["flow_grpo"]) if "flow_grpo" in finals else None
    summary = {"target": target, "score": SCORE, "methods": {}}

    def ms(xs):
        xs = [x for x in xs if x is not None]
        if not xs:
            return None, None
        return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)

    ref_steps = ref_wall = None
    for m in by:
        rs = by[m]
        s = {
            "n_seeds": len(rs),
            "final_partial": ms(finals[m]),
            "final_strict": ms([r["evals"][-1]["scores"]["overall"]["strict"] for r in rs]),
            "base_partial": ms([r["evals"][0]["scores"]["overall"][SCORE] for r in rs]),
            "train_prompts_base_partial": ms([r["evals"][0]["train_scores"]["overall"][SCORE] for r in rs]),
            "train_prompts_final_partial": ms([r["evals"][-1]["train_scores"]["overall"][SCORE] for r in rs]),
            "final_train_reward_last5": ms([statistics.mean(i["reward"] for i in r["iterations"][-5:]) for r in rs]),
            "first_train_reward_first5": ms([statistics.mean(i["reward"] for i in r["iterations"][:5]) for r in rs]),
            "final_cleanliness": ms([r["evals"][-1]["scores"]["overall"]["cleanliness"] for r in rs]),
            "final_kl": ms([r["evals"][-1]["kl"] for r in rs]),
            "per_category_final_strict": {
                c: ms([r["evals"][-1]["scores"][c]["strict"] for r in rs])[0]
                for c in rs[0]["evals"][-1]["scores"] if c != "overall"},
            "clip_frac": ms([statistics.mean(i.get("clip_frac", 0.0) for i in r["iterations"]) for r in rs]),
            "clip_frac_off_policy": ms([_mean_key(r["iterations"], "clip_frac_off_policy") for r in rs]),
            "time_per_iter_s": ms([r["iterations"][-1]["wall_s"] / len(r["iterations"]) for r in rs]),
        }
        if target is not None:
            s["steps_to_target"] = [_first_reaching(r["evals"], target, "step") for r in rs]
            s["wall_to_target"] = [_first_reaching(r["evals"], target, "wall_s") for r in rs]
            s["kl_at_target"] = [_first_reaching(r["evals"], target, "kl") for r in rs]
        summary["methods"][m] = s
    if "flow_grpo" in summary["methods"] and target is not None:
        ref = summary["methods"]["flow_grpo"]
        ref_steps = ms(ref["steps_to_target"])[0]
        ref_wall = ms(ref["wall_to_target"])[0]
    lines = [f"Score: eval `{SCORE}` on held-out test prompts (ODE, {BASE['eval_num_inference_steps']} steps). "
             f"Target = Flow-GRPO's mean final score = {target:.4f}." if target is not None else "",
             "",
             "| method | seeds | base | final partial | final strict | cleanliness | KL final | steps-to-target (rel.) "
             "| wall-to-target (rel.) | KL at target | clip frac | off-policy clip frac | s/iter |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines_train = ["", "Learning on the training prompts (same evaluation on train-split prompts; rollout reward):", "",
                   "| method | train prompts: base | train prompts: final | rollout reward, first 5 iters | last 5 iters |",
                   "|---|---|---|---|---|"]

    def f(pair, nd=3):
        if pair is None or pair[0] is None:
            return "n/a"
        return f"{pair[0]:.{nd}f} ± {pair[1]:.{nd}f}"

    for m, s in summary["methods"].items():
        reached = [x for x in s.get("steps_to_target", []) if x is not None]
        st = ms(reached)[0]
        wt = ms([x for x in s.get("wall_to_target", []) if x is not None])[0]
        rel_s = f"{st / ref_steps:.2f}x ({len(reached)}/{s['n_seeds']} reached)" if st and ref_steps else "n/a"
        rel_w = f"{wt / ref_wall:.2f}x" if wt and ref_wall else "n/a"
        kl_t = ms([x for x in s.get("kl_at_target", []) if x is not None])
        lines.append(f"| {m} | {s['n_seeds']} | {f(s['base_partial'])} | {f(s['final_partial'])} | "
                     f"{f(s['final_strict'])} | {f(s['final_cleanliness'])} | {f(s['final_kl'], 5)} | {rel_s} | "
                     f"{rel_w} | {f(kl_t, 5)} | {f(s['clip_frac'])} | {f(s['clip_frac_off_policy'])} | "
                     f"{f(s['time_per_iter_s'], 1)} |")
        lines_train.append(f"| {m} | {f(s['train_prompts_base_partial'])} | {f(s['train_prompts_final_partial'])} | "
                           f"{f(s['first_train_reward_first5'])} | {f(s['final_train_reward_last5'])} |")
    lines += lines_train
    cats = list(next(iter(summary["methods"].values()))["per_category_final_strict"])
    lines += ["", "Final strict accuracy per category (mean over seeds):", "",
              "| method | " + " | ".join(cats) + " |", "|---|" + "---|" * len(cats)]
    for m, s in summary["methods"].items():
        lines.append(f"| {m} | " + " | ".join(f"{s['per_category_final_strict'][c]:.3f}" for c in cats) + " |")
    return summary, "\n".join(lines) + "\n"


def _mean_key(rows, key):
    vals = [r[key] for r in rows if key in r and not math.isnan(r[key])]
    return statistics.mean(vals) if vals else None


def plot(runs: list[dict], out: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for xkey, fname, xlabel in (("step", "score_vs_step.png", "iteration"),
                                ("wall_s", "score_vs_time.png", "wall-clock (s, training only)"),
                                ("kl", "score_vs_kl.png", "KL to base model")):
        fig, ax = plt.subplots(figsize=(6, 4))
        methods = sorted({r["method"] for r in runs}, key=list(METHODS).index)
        for i, m in enumerate(methods):
            for j, r in enumerate([r for r in runs if r["method"] == m]):
                xs = [e[xkey] for e in r["evals"]]
                ys = [e["scores"]["overall"][SCORE] for e in r["evals"]]
                ax.plot(xs, ys, color=f"C{i}", alpha=0.8, marker=".", label=m if j == 0 else None)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"eval {SCORE} (test prompts)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        p = os.path.join(out, fname)
        fig.savefig(p, dpi=100)
        plt.close(fig)
        paths.append(p)
    return paths


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--per-category", type=int, default=20, help="eval prompts per category")
    ap.add_argument("--out", default="benchmarks/results/shapes")
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 seed, flow_grpo + op_grpo, 3 iterations")
    ap.add_argument("--summarise-only", action="store_true",
                    help="rebuild table.md and the plots from an existing --out/results.json (e.g. a partial run)")
    ap.add_argument("--merge", nargs="+", default=None,
                    help="with --summarise-only: also take the runs of these other output folders (runs done by "
                         "parallel processes), merged into --out")
    args = ap.parse_args(argv)
    if args.summarise_only:
        with open(os.path.join(args.out, "results.json")) as f:
            data = json.load(f)
        runs = data["runs"]
        for other in args.merge or []:
            with open(os.path.join(other, "results.json")) as f:
                extra = json.load(f)
            if extra["base"] != data["base"]:
                raise ValueError(f"--merge {other}: its BASE config differs from {args.out}'s")
            seen = {(r["method"], r["seed"]) for r in runs}
            runs += [r for r in extra["runs"] if (r["method"], r["seed"]) not in seen]
        return _write_outputs(runs, data["args"], data["base"], args.out)
    if args.quick:
        args.methods, args.seeds, args.steps, args.eval_every, args.per_category = (
            ["flow_grpo", "op_grpo"], [0], 3, 2, 2)
        BASE.update(prompts_per_step=4, num_generations=4, per_device_train_batch_size=16, num_inference_steps=6,
                    eval_num_inference_steps=10)
    os.makedirs(args.out, exist_ok=True)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    runs = []
    for seed in args.seeds:
        for method in args.methods:
            runs.append(run_one(method, seed, args.steps, args.eval_every, args.per_category, args.out))
            with open(os.path.join(args.out, "results.json"), "w") as f:
                json.dump({"args": vars(args), "base": BASE, "runs": runs}, f)
    return _write_outputs(runs, vars(args), BASE, args.out)


def _write_outputs(runs, args, base, out):
    summary, table = summarise(runs)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"args": args, "base": base, "summary": summary, "runs": runs}, f)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(table)
    plot(runs, out)
    print(table)
    return summary


if __name__ == "__main__":
    main()
