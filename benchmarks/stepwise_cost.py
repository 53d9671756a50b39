"""Cost of one Stepwise-Flow-GRPO iteration relative to one Flow-GRPO iteration (the paper: about 2x).

Same prompts, group size, steps, guidance and batch for every method; per iteration it counts the transformer
forward calls and the rows they process (a hook on the transformer; CFG doubles the rows; update calls are
forward + backward) and times the whole ``training_iteration`` and the intermediate rewards
(``stepwise/extra_s``). Iterations of the methods are interleaved after one warm-up each; medians are reported.
The Stepwise rows ``stepwise_t<T'>`` run StepwiseFlowGRPOConfig's default sampler (whatever it is; each row records
its sampler and T'), at T' = 1 (Tweedie), 2, 3 and 5 (the paper's); ``stepwise_t5_ddim`` is the paper's kernel,
to compare with ``flow_grpo_ddim``.

    python benchmarks/stepwise_cost.py                    # tiny pipeline (2 layers, 32 px), 10 steps, cfg 4.5
    python benchmarks/stepwise_cost.py --pipeline shapes  # the committed shapes base model
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

METHODS = {  # name -> (registered trainer name, overrides)
    "flow_grpo": ("grpo", {}),
    "flow_grpo_ddim": ("grpo", {"sampler": "ddim"}),
    "stepwise_t5": ("stepwise", {"num_substeps": 5}),
    "stepwise_t3": ("stepwise", {"num_substeps": 3}),
    "stepwise_t2": ("stepwise", {"num_substeps": 2}),
    "stepwise_t1": ("stepwise", {"num_substeps": 1}),
    "stepwise_t5_ddim": ("stepwise", {"num_substeps": 5, "sampler": "ddim"}),
}


def brightness(images, prompts, **kwargs):
    return images.mean(dim=(1, 2, 3))


def main(argv=None):
    import trl_flow
    from trl_flow.testing import tiny_sd3_pipeline

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pipeline", choices=["tiny", "shapes"], default="tiny")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--guidance", type=float, default=4.5)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                   "stepwise_cost.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    n = args.generations * args.prompts
    if args.pipeline == "shapes":
        from trl_flow.tasks import shapes

        load, size, seq, prompts = shapes.load_base_pipeline, 32, shapes.MAX_SEQUENCE_LENGTH, shapes.train_prompts()
    else:
        load, size, seq, prompts = tiny_sd3_pipeline, 32, 16, ["a cat", "a red dog", "a blue car", "green sky"]
    shared = dict(max_steps=1, num_generations=args.generations, prompts_per_step=args.prompts, height=size,
                  width=size, max_sequence_length=seq, num_inference_steps=args.steps, guidance_scale=args.guidance,
                  per_device_train_batch_size=n, per_device_eval_batch_size=n, lora_r=8, lora_alpha=16,
                  learning_rate=1e-4, clip_range=1e-2, disable_tqdm=True)
    trainers, counters, kernels = {}, {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (trainer_name, overrides) in METHODS.items():
            tr_cls = trl_flow.get_trainer(trainer_name)
            cfg = tr_cls.config_class(output_dir=os.path.join(tmp, name), **shared, **overrides)
            kernels[name] = {"sampler": cfg.sampler, "num_substeps": getattr(cfg, "num_substeps", None)}
            pipe = load()
            trainers[name] = tr_cls(cfg, pipe, [brightness], train_dataset=prompts)
            counters[name] = {"calls": 0, "rows": 0}

            def hook(module, inputs, kwargs, output, c=counters[name]):
                c["calls"] += 1
                c["rows"] += kwargs["hidden_states"].shape[0]

            pipe.transformer.register_forward_hook(hook, with_kwargs=True)
        samples = {name: [] for name in METHODS}
        for rep in range(args.repeats + 1):  # interleaved; repetition 0 is the warm-up
            for name, trainer in trainers.items():
                c = counters[name]
                c["calls"] = c["rows"] = 0
                t0 = time.perf_counter()
                m = trainer.training_iteration(rep)
                dt = time.perf_counter() - t0
                if rep:
                    samples[name].append({"s": dt, "calls": c["calls"], "rows": c["rows"],
                                          "extra_s": m.get("stepwise/extra_s", 0.0),
                                          "extra_rows": m.get("stepwise/extra_velocity_evals", 0.0)})
    res = {}
    for name, rows in samples.items():
        res[name] = {**kernels[name], **{k: statistics.median(r[k] for r in rows) for k in rows[0]}}
    base = res["flow_grpo"]
    print(f"{args.pipeline} pipeline, {n} samples, {args.steps} steps, cfg {args.guidance}, medians of "
          f"{args.repeats}\n")
    print(f"{'method':<16} {'sampler':>8} {'s/iter':>8} {'x FG':>6} {'fwd calls':>9} {'x FG':>6} {'rows':>6} "
          f"{'x FG':>6} {'interm. s':>9} {'share':>6}")
    for name, r in res.items():
        r["time_ratio_vs_flow_grpo"] = r["s"] / base["s"]
        r["calls_ratio_vs_flow_grpo"] = r["calls"] / base["calls"]
        r["rows_ratio_vs_flow_grpo"] = r["rows"] / base["rows"]
        print(f"{name:<16} {r['sampler']:>8} {r['s']:>8.3f} {r['time_ratio_vs_flow_grpo']:>6.2f} {r['calls']:>9.0f} "
              f"{r['calls_ratio_vs_flow_grpo']:>6.2f} {r['rows']:>6.0f} {r['rows_ratio_vs_flow_grpo']:>6.2f} "
              f"{r['extra_s']:>9.3f} {r['extra_s'] / r['s']:>6.2f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {"args": {k: v for k, v in vars(args).items() if k != "out"}, "torch": torch.__version__, "results": res},
            f, indent=2)
    print(f"\nwrote {args.out}")
    return res


if __name__ == "__main__":
    main()
