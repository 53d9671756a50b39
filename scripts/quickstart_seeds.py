"""The quickstart over seeds: does its gain hold for every seed? (the T' measurement)

    python scripts/quickstart_seeds.py --seeds 0 1 2 3 4              # the real quickstart per seed -> seeds.json
    python scripts/quickstart_seeds.py --curve --seeds 0 1 2 3 4 --steps 30 --eval_at 10 15 20 25 30 \\
        --set learning_rate=1e-3 --out /tmp/curve.json                  # one training per seed, scored on the way

Default mode runs ``examples/quickstart.py`` as a user would (``--seed S --output_dir <work>/seed<S>``) and collects
each ``scores.json`` into ``--out`` (``benchmarks/results/quickstart/seeds.json``: per seed the trained- and
held-out-prompt strict / partial before and after and the training's CPU seconds, then the median and range of the
gains). README.md quotes that file (tests/test_docs.py checks it).

``--curve`` is the search tool that chose the quickstart's setting: per seed, one training of ``--steps``
iterations, scored on the trained prompts (the quickstart's evaluation: seed 1234, ``--images_per_prompt`` each)
at every ``--eval_at`` iteration, with the method's settings replaced by ``--set KEY=VALUE``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _quickstart():
    spec = importlib.util.spec_from_file_location("quickstart", os.path.join(ROOT, "examples", "quickstart.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _value(v: str):
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(v.lower(), v)


def curve(args) -> dict:
    from trl_flow.tasks import shapes

    qs = _quickstart()
    overrides = dict((kv.split("=", 1)[0], _value(kv.split("=", 1)[1])) for kv in args.set)
    out = {"method": args.method, "reward": args.reward, "overrides": overrides,
           "images_per_prompt": args.images_per_prompt, "seeds": {}}
    for seed in args.seeds:
        trainer, sets = qs.make_trainer(args.method, seed, args.steps, os.path.join(args.work, f"curve{seed}"),
                                        args.images_per_prompt, reward=args.reward, **overrides)
        prompts, cats = sets["trained_prompts"]

        def strict():
            images = trainer.generate(prompts, seed=1234)[0]
            return round(shapes.evaluate(images, prompts, cats)["overall"]["strict"], 4)

        row = {"0": strict()}
        cpu0 = time.process_time()
        trainer.model.train()
        for step in range(args.steps):
            trainer.training_iteration(step)
            trainer.state.global_step = step + 1
            if step + 1 in args.eval_at:
                row[str(step + 1)] = strict()
                trainer.model.train()
        row["train_cpu_s"] = round(time.process_time() - cpu0, 1)
        out["seeds"][str(seed)] = row
        print(f"seed {seed}: " + ", ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    return out


def seeds(args) -> dict:
    qs = _quickstart()
    rows = {}
    for seed in args.seeds:
        out_dir = os.path.join(args.work, f"seed{seed}")
        qs.main(["--seed", str(seed), "--output_dir", out_dir, "--method", args.method,
                 "--images_per_prompt", str(args.images_per_prompt)]
                + (["--steps", str(args.steps)] if args.steps else []))
        with open(os.path.join(out_dir, "scores.json"), encoding="utf-8") as f:
            rows[str(seed)] = json.load(f)
    return summarise(rows)


def summarise(rows: dict) -> dict:
    """Per seed the strict / partial before and after, then per split and score the gains' median and range."""
    per_seed = {s: {split: {k: [r[split]["before"]["overall"][k], r[split]["after"]["overall"][k]]
                            for k in ("strict", "partial")} for split in ("trained_prompts", "held_out_prompts")}
                | {"run": r["run"]} for s, r in rows.items()}
    gains = {}
    for split in ("trained_prompts", "held_out_prompts"):
        for k in ("strict", "partial"):
            g = [v[split][k][1] - v[split][k][0] for v in per_seed.values()]
            gains[f"{split}/{k}"] = {"median": statistics.median(g), "min": min(g), "max": max(g)}
    return {"seeds": per_seed, "gains": gains}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--method", default="dppo")
    ap.add_argument("--steps", type=int, default=None, help="iterations (default: the quickstart's)")
    ap.add_argument("--images_per_prompt", type=int, default=None, help="default: the quickstart's")
    ap.add_argument("--work", default="out/quickstart_seeds", help="where each seed's run is written")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "quickstart", "seeds.json"))
    ap.add_argument("--curve", action="store_true", help="the search mode (see above)")
    ap.add_argument("--eval_at", type=int, nargs="+", default=[10, 15, 20, 25, 30])
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reward", default="shapes_relation", help="--curve: the training reward")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.images_per_prompt is None:
        args.images_per_prompt = _quickstart_default("images_per_prompt")
    if args.curve:
        args.steps = args.steps or max(args.eval_at)
        result = curve(args)
    else:
        result = seeds(args)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")
    return result


def _quickstart_default(name: str):
    import re

    src = open(os.path.join(ROOT, "examples", "quickstart.py"), encoding="utf-8").read()
    return int(re.search(rf'"--{name}", type=int, default=(\d+)', src).group(1))


if __name__ == "__main__":
    sys.exit(main() and 0)
