"""Overhead of trl_flow over the bare diffusers / transformer compute, on the tiny SD3, FLUX.1 and Wan2.1 pipelines.

(a) rollout: an SDE rollout that stores states, means and log-probs vs ``pipe(...)`` with the same prompts, steps,
    batch and guidance (``output_type="latent"``). Two comparisons:
      - ``sample``: ``FlowGRPOTrainer.sample`` (prompt encoding + schedule + sampling) vs ``pipe(prompt=...)``;
      - ``loop``: ``rollout.sample_trajectories`` alone vs ``pipe(prompt_embeds=...)`` (both with pre-encoded prompts).
(b) update: ``FlowGRPOTrainer.optimize`` on one rollout (beta = 0 and beta > 0) vs the pure transformer
    forward + backward of the same calls: the same microbatches, the same trained steps, the same transformer
    inputs (recorded from the adapter: CFG-doubled batches for SD3, packed latents and ids for FLUX, two CFG passes
    for Wan), with ``loss = v.float().pow(2).mean(); loss.backward()``. The update runs with
    ``guidance_grad="both"`` so that it back-propagates through every call the baseline does. For beta > 0 a second
    baseline adds the no-grad reference forward that the exact KL needs (the cost a KL term cannot avoid).

Measurements are interleaved (A, B, A, B, ...) after warm-up, and medians are reported. Results go to
``benchmarks/results/overhead.json`` (replacing the entries of the variants run, keeping the others).

    python benchmarks/overhead.py                                   # tiny SD3, FLUX and Wan (9 frames), 32 px
    python benchmarks/overhead.py --variant sd3:6:64 --variant flux:4:64   # family:num_layers:sample_size
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


FAMILIES = {"sd3": 4.5, "flux": 3.5, "wan": 4.5}  # family -> default guidance (FLUX: distilled, one pass)


def tiny_pipeline(family: str, num_layers: int, sample_size: int):
    from trl_flow.testing import tiny_flux_pipeline, tiny_sd3_pipeline, tiny_wan_pipeline

    if family == "sd3":
        return tiny_sd3_pipeline(num_layers=num_layers, sample_size=sample_size)
    if family == "flux":
        return tiny_flux_pipeline(num_layers=num_layers, num_single_layers=num_layers, sample_size=sample_size)
    return tiny_wan_pipeline(num_layers=num_layers)


def record_transformer_calls(model, fn):
    """Run ``fn()`` and return a copy of the keyword arguments of every ``model`` forward it made."""
    calls = []

    def hook(module, args, kwargs):
        calls.append({k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            fn()
    finally:
        handle.remove()
    return calls


def bench_variant(family, num_layers, sample_size, batch, steps, guidance, repeats, warmup, out_dir, num_frames=9):
    from trl_flow import FlowGRPOConfig, FlowGRPOTrainer
    from trl_flow.rollout import sample_trajectories

    def brightness(images, prompts, **kwargs):
        return images.mean(dim=tuple(range(1, images.ndim)))

    guidance = FAMILIES[family] if guidance is None else guidance
    prompts_per_step = 2
    assert batch % prompts_per_step == 0
    G = batch // prompts_per_step
    mb = max(1, batch // 2)  # two microbatches per update
    dataset = ["a cat", "a red dog", "a blue car", "green sky"]
    res = {"family": family, "num_layers": num_layers, "sample_size": sample_size, "batch": batch, "steps": steps,
           "guidance_scale": guidance, "microbatch": mb}
    if family == "wan":
        res["num_frames"] = num_frames

    def make(beta, per_device):
        pipe = tiny_pipeline(family, num_layers, sample_size)
        cfg = FlowGRPOConfig(
            output_dir=os.path.join(out_dir, f"beta{beta}"), max_steps=1, num_generations=G,
            prompts_per_step=prompts_per_step, per_device_train_batch_size=per_device, height=sample_size,
            width=sample_size, num_frames=num_frames, max_sequence_length=16, num_inference_steps=steps,
            guidance_scale=guidance, beta=beta, lora_r=8, lora_alpha=16, learning_rate=1e-4, clip_range=1e-2,
            guidance_grad="both", disable_tqdm=True)  # back-propagate every transformer call, as the baseline does
        return pipe, FlowGRPOTrainer(cfg, pipe, [brightness], train_dataset=dataset)

    # ---------------------------------------------------------------------------------------- (a) rollout
    pipe, trainer = make(0.0, batch)  # sampling in one chunk == the pipeline's batch
    prompts, columns, group_ids = trainer.sample_prompts(0)
    adapter = trainer.adapter
    embeds = trainer.encode(prompts, guidance)
    schedule = adapter.schedule(steps, sample_size, sample_size)
    noise = trainer.initial_noise(0)
    kinds = trainer._step_kinds(0)
    # The adapters' prompt-embedding names are the pipelines' argument names; FLUX's pipeline takes packed latents.
    pipe_latents = adapter.pack(noise) if family == "flux" else noise
    common = dict(height=sample_size, width=sample_size, num_inference_steps=steps, guidance_scale=guidance,
                  output_type="latent", max_sequence_length=16)
    if family == "wan":
        common["num_frames"] = num_frames

    @torch.no_grad()
    def pipe_full():
        pipe(prompt=prompts, generator=torch.Generator().manual_seed(0), **common)

    @torch.no_grad()
    def pipe_loop():
        pipe(latents=pipe_latents.clone(), **embeds, **common)

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
        trained = rollout.trained_steps()
        # The exact transformer inputs of every (microbatch, trained step) call, recorded from the adapter outside
        # the timing (packed latents, ids, CFG batches or passes as the family makes them).
        calls = []
        for lo in range(0, len(rollout), mb):
            idx = torch.arange(lo, min(lo + mb, len(rollout)))
            for k in trained:
                calls += record_transformer_calls(model, lambda: trainer.forward_step(rollout, idx, k, need_ref=False))

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


def _variant_key(r: dict) -> tuple:
    return (r.get("family", "sd3"), r["num_layers"], r["sample_size"])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", default=None,
                    help="family:num_layers:sample_size (family: sd3, flux, wan; `num_layers:sample_size` means sd3); "
                         "repeatable (default sd3:2:32 flux:1:32 wan:2:32)")
    ap.add_argument("--batch", type=int, default=8, help="trajectories per rollout (2 prompts x batch/2)")
    ap.add_argument("--steps", type=int, default=10, help="sampling steps")
    ap.add_argument("--guidance", type=float, default=None,
                    help="guidance scale (default per family: sd3/wan CFG 4.5, two passes; flux distilled 3.5, one)")
    ap.add_argument("--num-frames", type=int, default=9, help="frames per Wan video")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: leave torch's default)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                   "overhead.json"))
    ap.add_argument("--fresh", action="store_true",
                    help="overwrite --out instead of replacing only the variants run now (others are kept)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    variants = args.variant or ["sd3:2:32", "flux:1:32", "wan:2:32"]
    meta = {"torch": torch.__version__, "threads": torch.get_num_threads(), "platform": platform.platform(),
            "processor": platform.processor(), "batch": args.batch, "steps": args.steps, "repeats": args.repeats,
            "warmup": args.warmup, "device": "cpu", "date": time.strftime("%Y-%m-%d")}
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for v in variants:
            parts = v.split(":")
            family = parts[0] if len(parts) == 3 else "sd3"
            if family not in FAMILIES:
                raise SystemExit(f"--variant {v}: family must be one of {sorted(FAMILIES)}")
            layers, size = (int(x) for x in parts[-2:])
            print(f"benchmarking {family} num_layers={layers} sample_size={size} ...", flush=True)
            r = bench_variant(family, layers, size, args.batch, args.steps, args.guidance, args.repeats,
                              args.warmup, tmp, num_frames=args.num_frames)
            r["meta"] = meta
            results.append(r)

    hdr = (f"{'variant':>14} | {'measure (medians)':<42} | {'trl_flow s':>10} | {'baseline s':>10} | {'ratio':>6} | "
           f"{'min/min':>7} | goal")
    print("\n" + hdr + "\n" + "-" * len(hdr))
    for r in results:
        name = f"{r['family']} {r['num_layers']}L/{r['sample_size']}px"
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
            print(f"{name:>14} | {label:<42} | {a:>10.4f} | {b:>10.4f} | {a / b:>6.3f} | {mins:>7.3f} | {goal}")
    kept = []
    if not args.fresh and os.path.exists(args.out):
        with open(args.out) as f:
            old = json.load(f)
        done = {_variant_key(r) for r in results}
        for r in old.get("results", []):
            if _variant_key(r) not in done:
                r.setdefault("family", "sd3")
                r.setdefault("meta", old.get("meta"))
                kept.append(r)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"results": kept + results}, f, indent=2)
    print(f"\nwrote {args.out} ({len(results)} variants run now, {len(kept)} kept from the previous file)")


if __name__ == "__main__":
    main()
