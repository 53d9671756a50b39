"""Overhead of trl_flow over the bare diffusers / transformer compute.

(a) rollout: an SDE rollout that stores states, means and log-probs vs ``pipe(...)`` with the same prompts, steps,
    batch and guidance (``output_type="latent"``). Two comparisons:
      - ``sample``: ``FlowGRPOTrainer.sample`` (prompt encoding + schedule + sampling) vs ``pipe(prompt=...)``;
      - ``loop``: ``rollout.sample_trajectories`` alone vs ``pipe(prompt_embeds=...)`` (both with pre-encoded prompts).
(b) update: ``FlowGRPOTrainer.optimize`` on one rollout (beta = 0 and beta > 0) vs the pure transformer
    forward + backward of the same calls: the same microbatches, the same trained steps, the same (CFG-doubled)
    inputs, with ``loss = v.float().pow(2).mean(); loss.backward()``. For beta > 0 a second baseline adds the
    no-grad reference forward that the exact KL needs (the cost a KL term cannot avoid).

Measurements are interleaved (A, B, A, B, ...) after warm-up, and medians are reported. Results go to
``benchmarks/results/overhead.json``.

    python benchmarks/overhead.py                                  # tiny pipeline (2 layers, 32 px)
    python benchmarks/overhead.py --variant 2:32 --variant 8:64    # plus a larger one (layers:sample_size)
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


def _median_times(fns: dict, repeats: int, warmup: int) -> dict[str, float]:
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():  # interleaved, so drift in machine load hits every variant alike
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    medians = {k: statistics.median(v) for k, v in times.items()}
    medians.update({f"{k}_min": min(v) for k, v in times.items()})
    return medians


def bench_variant(num_layers, sample_size, batch, steps, guidance, repeats, warmup, out_dir):
    from trl_flow import FlowGRPOConfig, FlowGRPOTrainer
    from trl_flow.rollout import sample_trajectories
    from trl_flow.testing import tiny_sd3_pipeline

    def brightness(images, prompts, **kwargs):
        return images.mean(dim=(1, 2, 3))

    prompts_per_step = 2
    assert batch % prompts_per_step == 0
    G = batch // prompts_per_step
    mb = max(1, batch // 2)  # two microbatches per update
    dataset = ["a cat", "a red dog", "a blue car", "green sky"]
    res = {"num_layers": num_layers, "sample_size": sample_size, "batch": batch, "steps": steps,
           "guidance_scale": guidance, "microbatch": mb}

    def make(beta, per_device):
        pipe = tiny_sd3_pipeline(num_layers=num_layers, sample_size=sample_size)
        cfg = FlowGRPOConfig(
            output_dir=os.path.join(out_dir, f"beta{beta}"), max_steps=1, num_generations=G,
            prompts_per_step=prompts_per_step, per_device_train_batch_size=per_device, height=sample_size,
            width=sample_size, max_sequence_length=16, num_inference_steps=steps, guidance_scale=guidance,
            beta=beta, lora_r=8, lora_alpha=16, learning_rate=1e-4, clip_range=1e-2, disable_tqdm=True)
        return pipe, FlowGRPOTrainer(cfg, pipe, [brightness], train_dataset=dataset)

    # ---------------------------------------------------------------------------------------- (a) rollout
    pipe, trainer = make(0.0, batch)  # sampling in one chunk == the pipeline's batch
    prompts, columns, group_ids = trainer.sample_prompts(0)
    adapter = trainer.adapter
    embeds = trainer.encode(prompts, guidance)
    schedule = adapter.schedule(steps, sample_size, sample_size)
    noise = trainer.initial_noise(0)
    kinds = trainer._step_kinds(0)
    pipe_embeds = {"prompt_embeds": embeds["prompt_embeds"], "pooled_prompt_embeds": embeds["pooled_prompt_embeds"]}
    if guidance > 1:
        pipe_embeds.update(negative_prompt_embeds=embeds["negative_prompt_embeds"],
                           negative_pooled_prompt_embeds=embeds["negative_pooled_prompt_embeds"])
    common = dict(height=sample_size, width=sample_size, num_inference_steps=steps, guidance_scale=guidance,
                  output_type="latent", max_sequence_length=16)

    @torch.no_grad()
    def pipe_full():
        pipe(prompt=prompts, generator=torch.Generator().manual_seed(0), **common)

    @torch.no_grad()
    def pipe_loop():
        pipe(latents=noise.clone(), **pipe_embeds, **common)

    def trl_sample():
        trainer.sample(prompts, columns, group_ids, 0)

    def trl_loop():
        sample_trajectories(adapter, trainer.model, embeds, noise, schedule, kinds, trainer.config.noise_level,
                            guidance, batch, generator=torch.Generator().manual_seed(0))

    t = _median_times({"pipe": pipe_full, "trl_sample": trl_sample, "pipe_loop": pipe_loop, "trl_loop": trl_loop},
                      repeats, warmup)
    res["rollout"] = {
        "pipe_s": t["pipe"], "trl_sample_s": t["trl_sample"], "ratio_sample": t["trl_sample"] / t["pipe"],
        "pipe_embeds_s": t["pipe_loop"], "trl_loop_s": t["trl_loop"], "ratio_loop": t["trl_loop"] / t["pipe_loop"],
        "ratio_sample_of_mins": t["trl_sample_min"] / t["pipe_min"],
        "ratio_loop_of_mins": t["trl_loop_min"] / t["pipe_loop_min"],
    }

    # ---------------------------------------------------------------------------------------- (b) update
    for beta in (0.0, 0.04):
        pipe, trainer = make(beta, mb)
        rollout = trainer.make_rollout(0)
        trainer.compute_advantages(rollout)
        model = trainer.model
        K = rollout.schedule.num_steps
        trained = [k for k in range(K) if bool(rollout.train_mask[:, k].any())]
        # the exact transformer inputs of every (microbatch, trained step) call, prepared outside the timing
        calls = []
        for lo in range(0, len(rollout), mb):
            idx = torch.arange(lo, min(lo + mb, len(rollout)))
            emb = {k: v[idx] for k, v in rollout.embeds.items()}
            for k in trained:
                x = rollout.states[idx, k]
                if guidance > 1:
                    hs = torch.cat([x, x])
                    pe = torch.cat([emb["negative_prompt_embeds"], emb["prompt_embeds"]])
                    pooled = torch.cat([emb["negative_pooled_prompt_embeds"], emb["pooled_prompt_embeds"]])
                else:
                    hs, pe, pooled = x, emb["prompt_embeds"], emb["pooled_prompt_embeds"]
                ts = rollout.schedule.timesteps[k].expand(hs.shape[0])
                calls.append(dict(hidden_states=hs, timestep=ts, encoder_hidden_states=pe, pooled_projections=pooled,
                                  return_dict=False))

        def fwd_bwd(with_ref: bool):
            model.train()
            for kw in calls:
                v = model(**kw)[0]
                loss = v.float().pow(2).mean()
                loss.backward()
                if with_ref:
                    with torch.no_grad(), trainer.reference_policy() as ref:
                        ref(**kw)
            for p in trainer.trainable_params:
                p.grad = None

        def trl_optimize():
            trainer.optimize(rollout, 0)

        fns = {"trl_optimize": trl_optimize, "fwd_bwd": lambda: fwd_bwd(False)}
        if beta > 0:
            fns["fwd_bwd_ref"] = lambda: fwd_bwd(True)
        t = _median_times(fns, repeats, warmup)
        entry = {"trained_steps": len(trained), "transformer_calls": len(calls), "trl_optimize_s": t["trl_optimize"],
                 "fwd_bwd_s": t["fwd_bwd"], "ratio": t["trl_optimize"] / t["fwd_bwd"],
                 "ratio_of_mins": t["trl_optimize_min"] / t["fwd_bwd_min"]}
        if beta > 0:
            entry["fwd_bwd_ref_s"] = t["fwd_bwd_ref"]
            entry["ratio_vs_fwd_bwd_ref"] = t["trl_optimize"] / t["fwd_bwd_ref"]
            entry["ratio_vs_fwd_bwd_ref_of_mins"] = t["trl_optimize_min"] / t["fwd_bwd_ref_min"]
        res[f"update_beta{beta:g}"] = entry
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", default=None,
                    help="num_layers:sample_size of the tiny SD3 pipeline; repeatable (default 2:32)")
    ap.add_argument("--batch", type=int, default=8, help="trajectories per rollout (2 prompts x batch/2)")
    ap.add_argument("--steps", type=int, default=10, help="sampling steps")
    ap.add_argument("--guidance", type=float, default=4.5, help="CFG scale (> 1: two transformer passes)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: leave torch's default)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                   "overhead.json"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    variants = args.variant or ["2:32"]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for v in variants:
            layers, size = (int(x) for x in v.split(":"))
            print(f"benchmarking num_layers={layers} sample_size={size} ...", flush=True)
            results.append(bench_variant(layers, size, args.batch, args.steps, args.guidance, args.repeats,
                                         args.warmup, tmp))

    hdr = (f"{'variant':>9} | {'measure (medians)':<42} | {'trl_flow s':>10} | {'baseline s':>10} | {'ratio':>6} | "
           f"{'min/min':>7} | goal")
    print("\n" + hdr + "\n" + "-" * len(hdr))
    for r in results:
        name = f"{r['num_layers']}L/{r['sample_size']}px"
        ro = r["rollout"]
        rows = [
            ("rollout: trainer.sample vs pipe(prompt)", ro["trl_sample_s"], ro["pipe_s"], ro["ratio_sample_of_mins"],
             "<=1.05"),
            ("rollout loop: sample_trajectories vs pipe", ro["trl_loop_s"], ro["pipe_embeds_s"],
             ro["ratio_loop_of_mins"], "<=1.05"),
        ]
        u0, u1 = r["update_beta0"], r["update_beta0.04"]
        rows += [
            ("update beta=0 vs fwd+bwd", u0["trl_optimize_s"], u0["fwd_bwd_s"], u0["ratio_of_mins"], "<=1.10"),
            ("update beta=0.04 vs fwd+bwd", u1["trl_optimize_s"], u1["fwd_bwd_s"], u1["ratio_of_mins"], "<=1.10"),
            ("update beta=0.04 vs fwd+bwd+ref fwd", u1["trl_optimize_s"], u1["fwd_bwd_ref_s"],
             u1["ratio_vs_fwd_bwd_ref_of_mins"], "<=1.10"),
        ]
        for label, a, b, mins, goal in rows:
            print(f"{name:>9} | {label:<42} | {a:>10.4f} | {b:>10.4f} | {a / b:>6.3f} | {mins:>7.3f} | {goal}")
    meta = {"torch": torch.__version__, "threads": torch.get_num_threads(), "platform": platform.platform(),
            "processor": platform.processor(), "batch": args.batch, "steps": args.steps, "guidance": args.guidance,
            "repeats": args.repeats, "warmup": args.warmup, "device": "cpu"}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=2)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
