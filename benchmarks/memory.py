"""Peak memory of training iterations vs the microbatch size and vs each memory option, on a tiny SD3 pipeline.

Every configuration runs in a fresh subprocess (one Python process per measurement, so nothing leaks between them)
and trains ``--iterations`` iterations of Flow-GRPO with a reward model that holds activations proportional to its
batch (an upsample to 224 px and a 64-channel convolution, like an image encoder's stem).

- CUDA: ``torch.cuda.max_memory_allocated`` during ``train()`` minus the memory allocated before it.
- CPU: peak resident set size during ``train()`` (psutil, sampled every millisecond) minus the RSS before it. RSS
  includes allocator slack and is noisier; with the model on the CPU, ``offload="model"`` has nothing to save there.

The microbatch sweep and the options run with reward calls of one image (``per_device_reward_batch_size=1``), so
the transformer's activations set the peak. Options compared at the largest microbatch: gradient checkpointing,
``offload="model"``, bf16, 8-bit AdamW (if bitsandbytes is installed), and reward calls on all images at once
(``per_device_reward_batch_size=None``, the default) to show what micro-batching the reward saves.

    python benchmarks/memory.py                       # writes benchmarks/results/memory.json
    python benchmarks/memory.py --sample_size 64 --batch_sizes 2 4 8   # quicker
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time

import torch


class RewardModel:
    """A stand-in reward model: images (B, 3, H, W) -> 224 px -> conv 3->64 -> mean. Memory ~ 13 MB per image."""

    __name__ = "reward_model"

    def __init__(self):
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(3, 64, 3, padding=1)

    @torch.no_grad()
    def __call__(self, images, prompts, **kwargs):
        x = torch.nn.functional.interpolate(images.to(self.conv.weight.device), size=224, mode="bilinear")
        return self.conv(x).relu().mean(dim=(1, 2, 3)).cpu()


def measure(spec: dict) -> dict:
    """Run one configuration in this process; returns its peak memory above the pre-train baseline (MiB)."""
    from trl_flow import FlowGRPOConfig, FlowGRPOTrainer
    from trl_flow.testing import tiny_sd3_pipeline

    torch.set_num_threads(1)
    size = spec["sample_size"]
    pipe = tiny_sd3_pipeline(sample_size=size, num_layers=spec["num_layers"])
    options = spec["options"]
    with tempfile.TemporaryDirectory() as out:
        config = FlowGRPOConfig(
            output_dir=out, max_steps=spec["iterations"], num_generations=spec["samples"], prompts_per_step=1,
            per_device_train_batch_size=spec["batch"], height=size, width=size, max_sequence_length=16,
            num_inference_steps=4, guidance_scale=4.5, lora_r=8, lora_alpha=16, beta=0.04, disable_tqdm=True,
            **options)
        trainer = FlowGRPOTrainer(config, pipe, [RewardModel()], train_dataset=["a cat", "a red dog"])
        cuda = trainer.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            trainer.train()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
        else:
            import psutil

            proc, stop, peak_rss = psutil.Process(), threading.Event(), [0]

            def sample():
                while not stop.is_set():
                    peak_rss[0] = max(peak_rss[0], proc.memory_info().rss)
                    time.sleep(0.001)

            base = proc.memory_info().rss
            thread = threading.Thread(target=sample, daemon=True)
            thread.start()
            trainer.train()
            stop.set()
            thread.join()
            peak = max(peak_rss[0], proc.memory_info().rss) - base
    return {**spec, "device": str(trainer.device), "metric": "cuda_max_allocated" if cuda else "cpu_peak_rss",
            "peak_mib": round(peak / 2**20, 2), "reward": trainer.state.log_history[-1]["reward"]}


def run(spec: dict) -> dict:
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", json.dumps(spec)],
                          capture_output=True, text=True, timeout=1200)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{spec}: {proc.stderr[-2000:]}")
    return json.loads(lines[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--sample_size", type=int, default=128, help="Image size in pixels of the tiny pipeline.")
    parser.add_argument("--num_layers", type=int, default=2)
    parser.add_argument("--samples", type=int, default=8, help="Trajectories per iteration (one prompt).")
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--iterations", type=int, default=1)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                      "memory.json"))
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(json.loads(args.one))), flush=True)
        return

    common = {"sample_size": args.sample_size, "num_layers": args.num_layers, "samples": args.samples,
              "iterations": args.iterations}
    results = {"batch_size": [], "options": []}
    one = {"per_device_reward_batch_size": 1}
    for b in args.batch_sizes:
        results["batch_size"].append(run({**common, "batch": b, "options": one}))
        print("batch", b, results["batch_size"][-1]["peak_mib"], "MiB", flush=True)
    b = max(args.batch_sizes)
    options = {"baseline": one, "gradient_checkpointing": {**one, "gradient_checkpointing": True},
               "offload_model": {**one, "offload": "model"}, "bf16": {**one, "bf16": True},
               "reward_batch_all": {}}
    if importlib.util.find_spec("bitsandbytes") is not None:
        options["adamw_8bit"] = {**one, "optim": "adamw_8bit"}
    base = None
    for name, opts in options.items():
        r = run({**common, "batch": b, "options": opts})
        r["option"] = name
        base = base if base is not None else r["peak_mib"]
        r["ratio_to_baseline"] = round(r["peak_mib"] / base, 3) if base else None
        results["options"].append(r)
        print(name, r["peak_mib"], "MiB", r["ratio_to_baseline"], flush=True)
    meta = {"torch": torch.__version__, "platform": platform.platform(), "threads": 1,
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None, **common,
            "note": "each value is one measurement in a fresh process; CPU RSS includes allocator slack"}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, **results}, f, indent=2)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
