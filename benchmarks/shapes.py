"""The shapes benchmark: do the methods' claims hold on a laptop?

Trains trl_flow trainers on the committed tiny SD3 shapes base model under equal budgets (same iterations, same
prompts and group size per iteration), several seeds, and evaluates every ``--eval-every`` iterations with the
ODE sampler (fixed noise) on prompts RL never trains on:

* ``val``: the held-out split of the same grammar (``grammar.val_prompts``: 20% of the train-split prompts, never
  trained on by RL), the benchmark's primary split;
* ``test``: the stricter held-out-pairs split (``grammar.test_prompts``: object pairs never seen together in any
  training prompt, nor in pretraining).

The task (``TASK``): RL trains on the train-split prompts of ``TASK["categories"]`` (minus ``val``) with the
``TASK["reward"]`` reward; the score is the detector's ``partial`` accuracy on ``val`` (strict is reported too).
Per evaluation it records strict / partial per category, shape cleanliness (not rewarded: catches reward hacking)
and the exact-kernel KL to the base model along the policy's ODE trajectories; per iteration the rollout reward,
clip / mask fractions and CPU seconds per phase. The search that chose this task and ``BASE`` is in
``docs/benchmarks.md``.

Outputs in ``--out``: ``results.json`` (every curve), ``summary.json`` (what a script needs: ``base``, per method
``seeds``, ``final_mean``, ``final_std``, ``steps_to_target`` relative to Flow-GRPO, ``kl_final``, the score's name,
and the acceptance checks), ``table.md``, ``score_vs_step.png``, ``score_vs_cpu.png``, ``score_vs_kl.png``.
Target for steps-to-target: base + ``TARGET_FRACTION`` x Flow-GRPO's mean final gain over the base.

    python benchmarks/shapes.py --quick                               # smoke run (~1 min), run by the test suite
    python benchmarks/shapes.py --jobs 2                              # Flow-GRPO + OP-GRPO, 3 seeds (~30 CPU-min)
    python benchmarks/shapes.py --jobs 2 --methods flow_grpo stepwise # any subset; finished runs are reused
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

import torch

SCORE = "partial"  # the benchmark's score: the detector's partial accuracy (strict is reported too)
PRIMARY = "val"  # the held-out split of the same grammar; "test" is the stricter held-out-pairs split
TARGET_FRACTION = 0.8
KL_NOISE_LEVEL = 0.7  # KL to the base model is measured with the flow_sde kernel at this noise level for every method

# The task: what RL trains on and with which reward (docs/benchmarks.md, "The signal search").
TASK = dict(categories=("position",), reward="partial")

# Shared by every method: the equal budget (reference-parity defaults: batch std, detached unconditional branch).
BASE = dict(
    height=32, width=32, num_inference_steps=10, guidance_scale=3.0, max_sequence_length=1,
    num_generations=8, prompts_per_step=8, per_device_train_batch_size=32, gradient_accumulation_steps=2,
    learning_rate=5e-4, clip_range=1e-3, beta=0.0, noise_level=0.7, lora_r=16, lora_alpha=32,
    same_noise_per_group=True, eval_num_inference_steps=20, per_device_eval_batch_size=200, disable_tqdm=True,
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
    # parity ablations of Flow-GRPO (the other two parity defaults held fixed)
    "flow_grpo_exact_kl": ("FlowGRPOConfig", "FlowGRPOTrainer", {"beta": 0.04, "kl_form": "exact"}),
    "flow_grpo_reference_kl": ("FlowGRPOConfig", "FlowGRPOTrainer", {"beta": 0.04, "kl_form": "reference"}),
    "flow_grpo_cfg_both": ("FlowGRPOConfig", "FlowGRPOTrainer", {"guidance_grad": "both"}),
    "flow_grpo_group_std": ("FlowGRPOConfig", "FlowGRPOTrainer", {"scale_rewards": "group"}),
    # Flow-DPPO (KL-mask trust region, paper delta 1e-7 for flow_sde) and its controls; beta stays BASE's 0 for all.
    "flow_dppo": ("FlowDPPOConfig", "FlowDPPOTrainer", {"num_inner_epochs": 2}),
    "flow_dppo_1epoch": ("FlowDPPOConfig", "FlowDPPOTrainer", {"num_inner_epochs": 1}),
    "flow_grpo_2epochs": ("FlowGRPOConfig", "FlowGRPOTrainer", {"num_inner_epochs": 2}),
    "flow_dppo_symmetric": ("FlowDPPOConfig", "FlowDPPOTrainer", {"num_inner_epochs": 2, "kl_mask_mode": "symmetric"}),
    "op_grpo_kl_mask": ("OPGRPOConfig", "OPGRPOTrainer", {"trust_region": "kl_mask"}),
    # Stepwise-Flow-GRPO: its own defaults (ddim, eta = noise_level, shared noise per group, T' = 5, joint)
    "stepwise": ("StepwiseFlowGRPOConfig", "StepwiseFlowGRPOTrainer", {}),
    "stepwise_per_step": ("StepwiseFlowGRPOConfig", "StepwiseFlowGRPOTrainer", {"gain_normalization": "per_step"}),
    "stepwise_t1": ("StepwiseFlowGRPOConfig", "StepwiseFlowGRPOTrainer", {"num_substeps": 1}),
}
DEFAULT_METHODS = ["flow_grpo", "op_grpo"]


# ----------------------------------------------------------------------------------------------- one run
def task_prompts():
    from trl_flow.tasks.shapes import grammar

    return grammar.rl_train_prompts(categories=TASK["categories"])


def eval_sets(per_category: int) -> dict[str, tuple[list[str], list[str]]]:
    """Fixed evaluation prompts of the task's categories: ``per_category`` draws (seeded, with replacement) per
    category from the ``val`` and the ``test`` split."""
    import numpy as np

    from trl_flow.tasks.shapes import grammar

    out = {}
    for split, ds in (("val", grammar.val_prompts()), ("test", grammar.test_prompts())):
        rng = np.random.default_rng(1234)
        prompts, cats = [], []
        for cat in TASK["categories"]:
            pool = [p for p, c in zip(ds["prompt"], ds["category"]) if c == cat]
            prompts += [pool[i] for i in rng.integers(0, len(pool), per_category)]
            cats += [cat] * per_category
        out[split] = (prompts, cats)
    return out


def evaluate(trainer, sets, kl_prompts: int = 64) -> dict:
    from trl_flow.tasks import shapes

    t0 = time.process_time()
    out = {}
    with trainer.ema_weights():
        for split, (prompts, cats) in sets.items():
            images, _ = trainer.generate(prompts, seed=1234)
            out[split] = shapes.evaluate(images, prompts, cats)
        val = sets[PRIMARY][0]
        # one kernel for every method (flow_sde, a = 0.7), so that methods trained with ddim compare
        out["kl"] = float(trainer.kl_to_reference(val[: min(len(val), kl_prompts)], seed=1234, sampler="flow_sde",
                                                  noise_level=KL_NOISE_LEVEL).mean())
    out["eval_cpu_s"] = time.process_time() - t0
    return out


def run_one(method: str, seed: int, steps: int, eval_every: int, per_category: int, out: str) -> dict:
    import trl_flow
    from trl_flow.tasks import shapes

    cfg_name, tr_name, overrides = METHODS[method]
    cfg_cls, tr_cls = getattr(trl_flow, cfg_name), getattr(trl_flow, tr_name)
    kwargs = {**BASE, **overrides, "seed": seed, "max_steps": steps,
              "output_dir": os.path.join(out, "runs", f"{method}_seed{seed}")}
    kwargs = {k: v for k, v in kwargs.items() if k in cfg_cls.__dataclass_fields__}
    config = cfg_cls(**kwargs)
    from trl_flow.rewards import get_reward

    reward = get_reward(f"shapes_{TASK['reward']}")  # the registry's shapes_partial / shapes_strict / shapes_dense
    trainer = tr_cls(config, shapes.load_base_pipeline(), [reward], train_dataset=task_prompts())
    sets = eval_sets(per_category)
    evals = [{"step": 0, "cpu_s": 0.0, **evaluate(trainer, sets)}]
    iters, cpu = [], 0.0
    for step in range(steps):
        t0 = time.process_time()
        m = trainer.training_iteration(step)
        trainer.state.global_step = step + 1
        cpu += time.process_time() - t0
        iters.append({"step": step + 1, "cpu_s": cpu, **{k: float(v) for k, v in m.items()}})
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            evals.append({"step": step + 1, "cpu_s": cpu, **evaluate(trainer, sets)})
            e = evals[-1]
            print(f"[{method} seed {seed}] step {step + 1}/{steps} reward {m['reward']:.3f} "
                  f"{PRIMARY} {e[PRIMARY]['overall'][SCORE]:.3f} test {e['test']['overall'][SCORE]:.3f} "
                  f"kl {e['kl']:.4f} ({cpu:.0f} cpu-s)", flush=True)
    return {"method": method, "seed": seed, "task": {**TASK, "categories": list(TASK["categories"])},
            "config": {k: str(v) for k, v in config.to_dict().items()}, "iterations": iters, "evals": evals,
            "cpu_s": cpu, "eval_cpu_s": sum(e["eval_cpu_s"] for e in evals)}


# --------------------------------------------------------------------------------------------- summary
def _ms(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return None, None
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def _final(run, split=PRIMARY, key=SCORE):
    return run["evals"][-1][split]["overall"][key]


def _first_reaching(evals, target, key):
    for e in evals:
        if e[PRIMARY]["overall"][SCORE] >= target - 1e-9:
            return e[key]
    return None


def _mean_key(rows, key):
    vals = [r[key] for r in rows if key in r and not math.isnan(r[key])]
    return statistics.mean(vals) if vals else None


def summarise(runs: list[dict]) -> dict:
    by: dict[str, list[dict]] = {}
    for r in runs:
        by.setdefault(r["method"], []).append(r)
    base = statistics.mean(r["evals"][0][PRIMARY]["overall"][SCORE] for r in runs)
    base_test = statistics.mean(r["evals"][0]["test"]["overall"][SCORE] for r in runs)
    base_clean = statistics.mean(r["evals"][0][PRIMARY]["overall"]["cleanliness"] for r in runs)
    target = None
    if "flow_grpo" in by:
        gain = statistics.mean(_final(r) for r in by["flow_grpo"]) - base
        target = base + TARGET_FRACTION * gain if gain > 0 else None
    summary = {"score": f"{SCORE} accuracy on the {PRIMARY} split (held-out prompts of the same grammar)",
               "score_key": SCORE, "split": PRIMARY, "task": {**TASK, "categories": list(TASK["categories"])},
               "base": base, "base_test": base_test, "target": target, "target_fraction": TARGET_FRACTION,
               "methods": {}}
    for m in sorted(by, key=lambda name: list(METHODS).index(name) if name in METHODS else len(METHODS)):
        rs = by[m]
        finals = [_final(r) for r in rs]
        s = {
            "seeds": [r["seed"] for r in rs],
            "final_mean": _ms(finals)[0], "final_std": _ms(finals)[1],
            "final_strict": _ms([_final(r, key="strict") for r in rs]),
            "final_test": _ms([_final(r, "test") for r in rs]),
            "final_test_strict": _ms([_final(r, "test", "strict") for r in rs]),
            "cleanliness_final": _ms([_final(r, key="cleanliness") for r in rs]),
            "kl_final": _ms([r["evals"][-1]["kl"] for r in rs])[0],
            "reward_first10": _ms([statistics.mean(i["reward"] for i in r["iterations"][:10]) for r in rs]),
            "reward_last10": _ms([statistics.mean(i["reward"] for i in r["iterations"][-10:]) for r in rs]),
            "clip_frac": _ms([_mean_key(r["iterations"], "clip_frac") for r in rs]),
            "clip_frac_off_policy": _ms([_mean_key(r["iterations"], "clip_frac_off_policy") for r in rs]),
            "mask_frac": _ms([_mean_key(r["iterations"], "mask_frac") for r in rs]),
            "cpu_s_per_iter": _ms([r["cpu_s"] / len(r["iterations"]) for r in rs]),
            "cpu_s_per_run": _ms([r["cpu_s"] + r["eval_cpu_s"] for r in rs]),
        }
        s.update(steps_to_target=None, cpu_to_target=None, n_reached=0)  # relative to Flow-GRPO; None: no target
        if target is not None:
            steps = [_first_reaching(r["evals"], target, "step") for r in rs]
            cpus = [_first_reaching(r["evals"], target, "cpu_s") for r in rs]
            s["steps_to_target_per_seed"] = steps
            s["n_reached"] = sum(x is not None for x in steps)
            s["cpu_to_target_per_seed"] = cpus
            s["kl_at_target"] = _ms([_first_reaching(r["evals"], target, "kl") for r in rs])[0]
        summary["methods"][m] = s
    if target is not None:
        ref = summary["methods"]["flow_grpo"]
        ref_steps = _ms(ref["steps_to_target_per_seed"])[0]
        ref_cpu = _ms(ref["cpu_to_target_per_seed"])[0]
        for s in summary["methods"].values():
            st, ct = _ms(s["steps_to_target_per_seed"])[0], _ms(s["cpu_to_target_per_seed"])[0]
            s["steps_to_target"] = st / ref_steps if st and ref_steps else None
            s["cpu_to_target"] = ct / ref_cpu if ct and ref_cpu else None
    if "flow_grpo" in summary["methods"]:
        fg = summary["methods"]["flow_grpo"]
        gain = fg["final_mean"] - base
        summary["acceptance"] = {
            "gain": gain,
            "gain_at_least_0.08": gain >= 0.08,
            "gain_at_least_3_std": gain >= 3 * fg["final_std"] and len(fg["seeds"]) >= 3,
            "training_reward_rises": fg["reward_last10"][0] > fg["reward_first10"][0],
            "cleanliness_drop": base_clean - fg["cleanliness_final"][0],
            "cleanliness_ok": base_clean - fg["cleanliness_final"][0] <= 0.01,
            "cpu_s_per_run": fg["cpu_s_per_run"][0],
            "within_25_cpu_minutes": fg["cpu_s_per_run"][0] <= 25 * 60,
        }
    return summary


def table(summary: dict) -> str:
    def f(pair, nd=3):
        if pair is None or pair[0] is None:
            return "n/a"
        return f"{pair[0]:.{nd}f} ± {pair[1]:.{nd}f}"

    def rel(x, n, total):
        return f"{x:.2f}x ({n}/{total} reached)" if x is not None else f"n/a ({n}/{total} reached)"

    t = summary.get("target")
    lines = [f"Score: `{SCORE}` on the `{PRIMARY}` split (held-out prompts of the same grammar, categories "
             f"{', '.join(summary['task']['categories'])}; ODE, fixed noise). Base model: {summary['base']:.3f} "
             f"({summary['base_test']:.3f} on the held-out-pairs `test` split). Target = base + "
             f"{TARGET_FRACTION:g} x Flow-GRPO's mean gain = " + (f"{t:.3f}." if t is not None else "n/a."), "",
             "| method | seeds | final (val) | final strict (val) | final (test, held-out pairs) | cleanliness | "
             "KL to base | steps-to-target | CPU-to-target | clip frac | off-policy clip frac | mask frac | "
             "reward first 10 -> last 10 | CPU s/iter |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m, s in summary["methods"].items():
        n = len(s["seeds"])
        lines.append(
            f"| {m} | {n} | {f((s['final_mean'], s['final_std']))} | {f(s['final_strict'])} | {f(s['final_test'])} | "
            f"{f(s['cleanliness_final'], 4)} | {s['kl_final']:.4f} | "
            f"{rel(s.get('steps_to_target'), s.get('n_reached', 0), n)} | "
            f"{rel(s.get('cpu_to_target'), s.get('n_reached', 0), n)} | {f(s['clip_frac'])} | "
            f"{f(s['clip_frac_off_policy'])} | {f(s['mask_frac'])} | "
            f"{s['reward_first10'][0]:.3f} -> {s['reward_last10'][0]:.3f} | {f(s['cpu_s_per_iter'], 2)} |")
    if "acceptance" in summary:
        a = summary["acceptance"]
        lines += ["", f"Acceptance (Flow-GRPO): gain {a['gain']:+.3f} (>= 0.08: {a['gain_at_least_0.08']}; >= 3 std: "
                  f"{a['gain_at_least_3_std']}); training reward rises: {a['training_reward_rises']}; cleanliness "
                  f"drop {a['cleanliness_drop']:+.4f} (<= 0.01: {a['cleanliness_ok']}); CPU per run "
                  f"{a['cpu_s_per_run'] / 60:.1f} min (<= 25: {a['within_25_cpu_minutes']})."]
    return "\n".join(lines) + "\n"


def plot(runs: list[dict], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [m for m in METHODS if any(r["method"] == m for r in runs)]
    for xkey, fname, xlabel in (("step", "score_vs_step.png", "iteration"),
                                ("cpu_s", "score_vs_cpu.png", "CPU seconds (one core, training only)"),
                                ("kl", "score_vs_kl.png", "KL to base model")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for i, m in enumerate(methods):
            for j, r in enumerate([r for r in runs if r["method"] == m]):
                xs = [e[xkey] for e in r["evals"]]
                ys = [e[PRIMARY]["overall"][SCORE] for e in r["evals"]]
                ax.plot(xs, ys, color=f"C{i % 10}", alpha=0.8, marker=".", label=m if j == 0 else None)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"{SCORE} accuracy ({PRIMARY} prompts)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(os.path.join(out, fname), dpi=100)
        plt.close(fig)


def write_outputs(runs, args: dict, out: str) -> dict:
    summary = summarise(runs)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"args": args, "base": BASE, "task": summary["task"], "summary": summary, "runs": runs}, f)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    text = table(summary)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(text)
    plot(runs, out)
    print(text)
    return summary


# ------------------------------------------------------------------------------------------------ main
def _run_file(out, method, seed):
    return os.path.join(out, "runs", f"{method}_seed{seed}.json")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=DEFAULT_METHODS, choices=list(METHODS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--per-category", type=int, default=100, help="eval prompts per category and split")
    ap.add_argument("--jobs", type=int, default=1, help="runs in parallel, one single-threaded process each")
    ap.add_argument("--out", default="benchmarks/results/shapes")
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 seed, flow_grpo + op_grpo, 3 iterations")
    ap.add_argument("--summarise-only", action="store_true", help="rebuild the outputs from --out/runs/*.json")
    ap.add_argument("--run-one", nargs=2, metavar=("METHOD", "SEED"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.methods, args.seeds, args.steps, args.eval_every, args.per_category = (
            ["flow_grpo", "op_grpo"], [0], 3, 2, 4)
        BASE.update(prompts_per_step=4, num_generations=4, per_device_train_batch_size=16, num_inference_steps=6,
                    eval_num_inference_steps=10)
    os.makedirs(os.path.join(args.out, "runs"), exist_ok=True)
    if args.run_one:
        torch.set_num_threads(1)
        method, seed = args.run_one[0], int(args.run_one[1])
        run = run_one(method, seed, args.steps, args.eval_every, args.per_category, args.out)
        tmp = _run_file(args.out, method, seed) + ".tmp"
        with open(tmp, "w") as f:
            json.dump(run, f)
        os.replace(tmp, _run_file(args.out, method, seed))
        return run
    todo = [(m, s) for s in args.seeds for m in args.methods]
    if not args.summarise_only:
        missing = [(m, s) for m, s in todo if not os.path.exists(_run_file(args.out, m, s))]
        if args.jobs <= 1 or args.quick:
            torch.set_num_threads(1)
            for m, s in missing:
                main([*_passthrough(args), "--run-one", m, str(s)])
        else:
            _run_parallel(missing, args)
    runs = []
    for m, s in todo:
        if os.path.exists(_run_file(args.out, m, s)):
            with open(_run_file(args.out, m, s)) as f:
                runs.append(json.load(f))
    if args.summarise_only:  # every run in the folder
        runs = []
        for name in sorted(os.listdir(os.path.join(args.out, "runs"))):
            if name.endswith(".json"):
                with open(os.path.join(args.out, "runs", name)) as f:
                    runs.append(json.load(f))
    return write_outputs(runs, {k: v for k, v in vars(args).items() if k != "run_one"}, args.out)


def _passthrough(args) -> list[str]:
    out = ["--steps", str(args.steps), "--eval-every", str(args.eval_every), "--per-category",
           str(args.per_category), "--out", args.out]
    return out + (["--quick"] if args.quick else [])


def _run_parallel(todo, args) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    running: list[subprocess.Popen] = []
    queue = list(todo)
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
                    raise SystemExit(f"run {p.args[-2:]} failed with exit code {p.returncode}")


if __name__ == "__main__":
    main()
