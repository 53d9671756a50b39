"""Iteration time with a slow reward: scoring after sampling (``reward_num_workers=0``) vs scoring each microbatch
in a thread pool while the next one is sampled (``reward_num_workers`` = 1 and 4).

The reward sleeps ``--reward-ms`` per image (default 50 ms), like a remote reward server or a judge: the time is
spent waiting, not computing. Each variant is its own ``FlowGRPOTrainer`` on the tiny SD3 pipeline with the same
seed; full training iterations (sample + decode + score + update) are timed interleaved (A, B, C, A, B, C, ...)
after a warm-up, and medians are reported with the ratios overlapped / sequential from the same run, for the
whole iteration and for the rollout alone (sampling + scoring; the update is unchanged). The sampled
rewards of every variant are checked to be identical. Results go to ``benchmarks/results/rewards_overlap.json``.

    python benchmarks/rewards_overlap.py                  # 16 samples, microbatches of 4, 10 steps
    python benchmarks/rewards_overlap.py --repeats 5 --reward-ms 20
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time

import torch


def slow_reward(delay_s: float):
    def slow_brightness(images, prompts, **columns):
        time.sleep(delay_s * len(prompts))
        return images.mean(dim=(1, 2, 3)).tolist()

    return slow_brightness


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reward-ms", type=float, default=50.0, help="reward time per image, milliseconds")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 4], help="reward_num_workers of the overlapped runs")
    ap.add_argument("--prompts-per-step", type=int, default=4)
    ap.add_argument("--num-generations", type=int, default=4)
    ap.add_argument("--microbatch", type=int, default=4, help="per_device_train_batch_size")
    ap.add_argument("--steps", type=int, default=10, help="sampling steps")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                   "rewards_overlap.json"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from trl_flow import FlowGRPOConfig, FlowGRPOTrainer
    from trl_flow.testing import tiny_sd3_pipeline

    variants = [0] + list(args.workers)
    prompts = ["a cat", "a red dog", "a blue car", "green sky", "two owls", "a tree"]
    trainers = {}
    with tempfile.TemporaryDirectory() as tmp:
        for w in variants:
            cfg = FlowGRPOConfig(
                output_dir=os.path.join(tmp, f"w{w}"), max_steps=10**6, num_generations=args.num_generations,
                prompts_per_step=args.prompts_per_step, per_device_train_batch_size=args.microbatch, height=32,
                width=32, max_sequence_length=16, num_inference_steps=args.steps, guidance_scale=4.5, beta=0.0,
                lora_r=4, lora_alpha=8, disable_tqdm=True, reward_num_workers=w)
            trainers[w] = FlowGRPOTrainer(cfg, tiny_sd3_pipeline(), [slow_reward(args.reward_ms / 1000)],
                                          train_dataset=prompts)
        times = {w: [] for w in variants}
        rewards = {w: [] for w in variants}
        metrics = {w: [] for w in variants}
        for it in range(args.warmup + args.repeats):
            for w in variants:  # interleaved: drift in machine load hits every variant alike
                t0 = time.perf_counter()
                m = trainers[w].training_iteration(it)
                dt = time.perf_counter() - t0
                rewards[w].append(trainers[w].last_rollout.rewards.tolist())
                if it >= args.warmup:
                    times[w].append(dt)
                    metrics[w].append(m)
    identical = all(rewards[w] == rewards[0] for w in variants)
    n = args.prompts_per_step * args.num_generations
    seq = statistics.median(times[0])
    res = {
        "meta": {"torch": torch.__version__, "threads": torch.get_num_threads(), "platform": platform.platform(),
                 "samples_per_iteration": n, "microbatch": args.microbatch, "sampling_steps": args.steps,
                 "reward_ms_per_image": args.reward_ms, "repeats": args.repeats, "warmup": args.warmup},
        "identical_rewards": identical,
        "reward_s_per_iteration": n * args.reward_ms / 1000,
        "sequential": {"iteration_s": seq, "iteration_s_all": times[0],
                       "rollout_s": statistics.median(m["time/rollout_s"] for m in metrics[0]),
                       "update_s": statistics.median(m["time/update_s"] for m in metrics[0])},
    }
    for w in variants[1:]:
        med = statistics.median(times[w])
        res[f"overlapped_workers{w}"] = {
            "iteration_s": med, "iteration_s_all": times[w], "ratio_to_sequential": med / seq,
            "rollout_s": statistics.median(m["time/rollout_s"] for m in metrics[w]),
            "rollout_ratio_to_sequential": (statistics.median(m["time/rollout_s"] for m in metrics[w])
                                            / res["sequential"]["rollout_s"]),
            "reward_wait_s": statistics.median(m["time/reward_wait_s"] for m in metrics[w]),
        }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    print(f"{n} samples/iteration, microbatch {args.microbatch}, reward {args.reward_ms:g} ms/image "
          f"({res['reward_s_per_iteration']:.2f} s of reward per iteration); identical rewards: {identical}")
    print(f"  sequential            : {seq:.3f} s/iteration")
    for w in variants[1:]:
        r = res[f"overlapped_workers{w}"]
        print(f"  overlapped, {w} worker(s): {r['iteration_s']:.3f} s/iteration  ratio {r['ratio_to_sequential']:.2f}"
              f"  (rollout alone: ratio {r['rollout_ratio_to_sequential']:.2f})")
    print(f"wrote {args.out}")
    if not identical:
        raise SystemExit("overlapped scoring changed the rewards")


if __name__ == "__main__":
    main()
