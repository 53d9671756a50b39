"""Seconds from SIGTERM to a complete checkpoint of the last completed iteration (docs/reliability.md, "Under a
scheduler").

A child process trains (Flow-GRPO, LoRA, one process, no periodic checkpoints); once iteration 1 is logged, the
parent waits ``--delay`` seconds into iteration 2, sends SIGTERM and polls (every 10 ms) for a complete
``checkpoint-*`` folder (its completion marker, written last). Then the child is SIGKILLed, as a scheduler's grace
period ends. Also reported: the child's iteration time and the size of the checkpoint.

    python scripts/measure_preemption.py                       # both models, 3 repeats each
    python scripts/measure_preemption.py --model sd3-6 --repeats 1

Models: ``shapes`` (the shapes task's base model and recipe: `trl-flow grpo --config shapes_flow_grpo`) and
``sd3-6`` (the 6-layer tiny SD3 of benchmarks/overhead.py at 64 px, LoRA r 16 on its attention projections).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SHAPES = ["-m", "trl_flow.cli", "grpo", "--config", "shapes_flow_grpo", "--max_steps", "50", "--eval_steps", "0",
          "--save_steps", "0", "--logging_steps", "1", "--disable_tqdm", "true"]

SD3_CHILD = """
import sys
import torch
torch.set_num_threads(int(sys.argv[2]))
from trl_flow import FlowGRPOConfig, FlowGRPOTrainer
from trl_flow.testing import tiny_sd3_pipeline

def brightness(images, prompts, **kw):
    return images.mean(dim=(1, 2, 3))

cfg = FlowGRPOConfig(output_dir=sys.argv[1], max_steps=50, save_steps=0, eval_steps=0, logging_steps=1,
                     num_generations=4, prompts_per_step=2, per_device_train_batch_size=8, height=64, width=64,
                     max_sequence_length=16, num_inference_steps=10, guidance_scale=1.0, lora_r=16, lora_alpha=32,
                     beta=0.0, disable_tqdm=True)
FlowGRPOTrainer(cfg, tiny_sd3_pipeline(num_layers=6, sample_size=64), [brightness],
                train_dataset=["a cat", "a red dog", "a blue car", "green sky"]).train()
"""


def _complete(out: str) -> str | None:
    if not os.path.isdir(out):
        return None
    for name in sorted(os.listdir(out)):
        marker = os.path.join(out, name, "checkpoint_complete.json")
        if name.startswith("checkpoint-") and name[11:].isdigit() and os.path.isfile(marker):
            return name
    return None


def _logged_steps(out: str) -> list[int]:
    """The steps logged so far."""
    path = os.path.join(out, "log_history.jsonl")
    if not os.path.isfile(path):
        return []
    steps = []
    for line in open(path, encoding="utf-8"):
        try:
            steps.append(json.loads(line)["step"])
        except (ValueError, KeyError):
            pass
    return steps


def measure_once(model: str, delay: float, threads: int) -> dict:
    work = tempfile.mkdtemp(prefix="preempt-")
    out = os.path.join(work, "out")
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    if model == "shapes":
        cmd = [sys.executable, *SHAPES, "--output_dir", out]
    else:
        script = os.path.join(work, "child.py")
        with open(script, "w") as f:
            f.write(SD3_CHILD)
        cmd = [sys.executable, script, out, str(threads)]
    proc = subprocess.Popen(cmd, env=env, cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        seen = {}
        while len(seen) < 2:  # the times iterations 1 and 2 were logged: the iteration time
            if proc.poll() is not None:
                raise RuntimeError(f"the child exited ({proc.returncode}) before its second iteration")
            for s in _logged_steps(out):
                seen.setdefault(s, time.monotonic())
            time.sleep(0.01)
        iteration_s = seen[2] - seen[1]
        time.sleep(delay)  # inside iteration 3
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        while (name := _complete(out)) is None:
            if time.monotonic() - t0 > 600:
                raise RuntimeError("no complete checkpoint 600 s after SIGTERM")
            time.sleep(0.01)
        seconds = time.monotonic() - t0
        size = sum(os.path.getsize(os.path.join(out, name, f)) for f in os.listdir(os.path.join(out, name)))
        return {"seconds": seconds, "checkpoint": name, "iteration_s": iteration_s, "checkpoint_mb": size / 2**20}
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(work, ignore_errors=True)


def snapshot_cost(repeats: int = 20) -> dict:
    """Milliseconds the per-iteration copy (preemption.take_snapshot) takes on the 6-layer SD3 after one iteration,
    in this process (one torch thread)."""
    import torch

    from trl_flow import FlowGRPOConfig, FlowGRPOTrainer
    from trl_flow.testing import tiny_sd3_pipeline
    from trl_flow.engine import preemption

    torch.set_num_threads(1)
    work = tempfile.mkdtemp(prefix="preempt-")
    cfg = FlowGRPOConfig(output_dir=os.path.join(work, "out"), max_steps=1, num_generations=4, prompts_per_step=2,
                         per_device_train_batch_size=8, height=64, width=64, max_sequence_length=16,
                         num_inference_steps=10, guidance_scale=1.0, lora_r=16, lora_alpha=32, beta=0.0,
                         disable_tqdm=True)
    trainer = FlowGRPOTrainer(cfg, tiny_sd3_pipeline(num_layers=6, sample_size=64),
                              [lambda images, prompts, **kw: images.mean(dim=(1, 2, 3))], train_dataset=["a cat"] * 2)
    trainer.train()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        preemption.take_snapshot(trainer)
        times.append((time.perf_counter() - t0) * 1e3)
    shutil.rmtree(work, ignore_errors=True)
    return {"model": "sd3-6", "snapshot_ms_median": statistics.median(times), "snapshot_ms_max": max(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", choices=["shapes", "sd3-6"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--delay", type=float, default=0.3, help="seconds into iteration 3 before the SIGTERM")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--snapshot-cost", action="store_true", help="also time the per-iteration copy (sd3-6)")
    args = ap.parse_args()
    if args.snapshot_cost:
        print(json.dumps(snapshot_cost()), flush=True)
    for model in args.model or ["shapes", "sd3-6"]:
        runs = [measure_once(model, args.delay, args.threads) for _ in range(args.repeats)]
        secs = [r["seconds"] for r in runs]
        print(json.dumps({"model": model, "runs": runs, "median_s": statistics.median(secs), "max_s": max(secs)}),
              flush=True)


if __name__ == "__main__":
    main()
