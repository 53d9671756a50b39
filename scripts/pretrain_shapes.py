#!/usr/bin/env python
"""Pretrains the base pipeline of the shapes task on CPU.

    python scripts/pretrain_shapes.py --minutes 30 --out trl_flow/tasks/shapes/base_model

1. Renders ``--num-images`` ground-truth images of the TRAIN prompts (test prompts are never used), category
   weights ``--category-weights``, and encodes them with the hand-set VAE (latents (N, 3, 16, 16)).
   Caption noise (``--flip-relation-prob``, ``--swap-colors-prob``, ``--count-off-prob``): each image keeps
   the prompt it was rendered for, but its caption gets planted errors (``grammar.noisy_caption``), each with
   its own probability; a noisy caption that would be a held-out test prompt is replaced by the clean one.
   ``--init-from DIR`` fine-tunes an existing ``save_pretrained`` pipeline (its VAE is kept; its text encoders
   too unless ``--train-text-encoders``) instead of training a fresh transformer.
2. Trains the ``SD3Transformer2DModel`` with rectified flow: x_t = (1 - t) x0 + t eps, target eps - x0,
   logit-normal t, 10% empty captions, AdamW (0.9, 0.99), clip 1, warm-up then cosine decay to 0 over the run,
   EMA. ``--train-text-encoders`` trains both CLIP text encoders with it (prompts encoded in every step by the
   pipeline's own ``encode_prompt``, so the embeddings are those sampling uses); by default they stay frozen
   and random. The number of steps is fixed up front: ``--steps``, or measured from ``--minutes`` after a short timing
   run (the log prints the number, so ``--steps N`` reproduces a run exactly on any machine).
3. Evaluates EMA and raw weights at scheduler shifts ``--eval-shifts`` on a validation set (train prompts, new
   images), saves the best with ``save_pretrained`` (its shift in the scheduler config), and prints strict /
   partial accuracy per category on the train and the held-out test prompts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from trl_flow.tasks.shapes import grammar, model  # noqa: E402
from trl_flow.tasks.shapes.benchmark import evaluate_pipeline  # noqa: E402
from trl_flow.tasks.shapes.pretraining import optimizer_step, run_steps, set_lr  # noqa: E402
from trl_flow.tasks.shapes.reward import format_evaluation  # noqa: E402
from trl_flow.tasks.shapes.render import render  # noqa: E402

DEFAULT_WEIGHTS = "single=0.1,colors=0.2,counting=0.15,two_objects=0.2,position=0.35"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=model.BASE_MODEL_DIR, help="where save_pretrained writes the pipeline")
    p.add_argument("--minutes", type=float, default=30.0, help="training wall-clock budget (sets --steps)")
    p.add_argument("--steps", type=int, default=None, help="number of optimizer steps (overrides --minutes)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--ema", type=float, default=0.999)
    p.add_argument("--empty-prompt-prob", type=float, default=0.1)
    p.add_argument("--num-images", type=int, default=50_000)
    p.add_argument("--category-weights", default=DEFAULT_WEIGHTS)
    p.add_argument("--eval-per-category", type=int, default=40)
    p.add_argument("--eval-steps", type=int, default=model.DEFAULT_NUM_INFERENCE_STEPS)
    p.add_argument("--eval-guidance", type=float, default=model.DEFAULT_GUIDANCE_SCALE)
    p.add_argument("--eval-shifts", default="1,3")
    p.add_argument("--save", choices=["best", "ema", "raw"], default="best")
    p.add_argument("--state", default=None, help="optional path to save the raw and EMA weights of every trained "
                                                 "parameter")
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--init-from", default=None,
                   help="fine-tune this save_pretrained pipeline (e.g. trl_flow/tasks/shapes/base_model)")
    p.add_argument("--flip-relation-prob", type=float, default=0.0,
                   help="caption noise: a position caption names the opposite relation")
    p.add_argument("--swap-colors-prob", type=float, default=0.0,
                   help="caption noise: a pair caption swaps its two colours")
    p.add_argument("--train-text-encoders", action="store_true",
                   help="train both CLIP text encoders with the transformer (default: frozen, random)")
    p.add_argument("--text-encoder-lr", type=float, default=None,
                   help="peak learning rate of the text encoders with --train-text-encoders (default: --lr)")
    p.add_argument("--count-off-prob", type=float, default=0.0,
                   help="caption noise: a single / counting caption names a count off by one")
    return p.parse_args(argv)


def render_data(n: int, weights: dict[str, float], seed: int, flip_relation: float = 0.0,
                swap_colors: float = 0.0, count_off: float = 0.0):
    """Renders n training images of the train prompts and captions them (with planted errors at the given
    rates, see ``grammar.noisy_caption``). Returns (uint8 images (n, 3, 32, 32), caption indices (n,), caption
    list (the train prompts first, then the noisy captions that are not train prompts), noise statistics)."""
    ds = grammar.train_prompts()
    prompts = list(ds["prompt"])
    by_cat = {c: [i for i, cc in enumerate(ds["category"]) if cc == c] for c in grammar.CATEGORIES}
    cats = [c for c in grammar.CATEGORIES if weights.get(c, 0) > 0]
    probs = np.array([weights[c] for c in cats], dtype=np.float64)
    probs /= probs.sum()
    rng = np.random.default_rng(seed)
    cat_idx = rng.choice(len(cats), size=n, p=probs)
    idx = np.array([by_cat[cats[c]][rng.integers(len(by_cat[cats[c]]))] for c in cat_idx])
    images = np.stack([render(prompts[i], rng) for i in idx])
    captions = list(prompts)
    if flip_relation or swap_colors or count_off:
        noise_rng = np.random.default_rng([seed, 1])
        index = {p: i for i, p in enumerate(captions)}
        stats = {"relation": 0, "colors": 0, "count": 0, "kept_clean_test": 0, "noisy": 0}
        cap_idx = np.empty_like(idx)
        for k, i in enumerate(idx):
            cap, errors = grammar.noisy_caption(prompts[i], noise_rng, flip_relation, swap_colors, count_off)
            if errors and grammar.is_test_spec(grammar.parse_prompt(cap)):
                cap, errors = prompts[i], ()
                stats["kept_clean_test"] += 1
            for e in errors:
                stats[e] += 1
            stats["noisy"] += bool(errors)
            if cap not in index:
                index[cap] = len(captions)
                captions.append(cap)
            cap_idx[k] = index[cap]
        per_cat = Counter(ds["category"][i] for i in idx)
        stats["images_per_category"] = dict(per_cat)
        return images, cap_idx, captions, stats
    return images, idx, captions, {}


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t_start = time.time()
    weights = {k: float(v) for k, v in (kv.split("=") for kv in args.category_weights.split(","))}
    print(f"args: {vars(args)}", flush=True)

    if args.init_from:
        pipe = model.load_base_pipeline(path=args.init_from)
        print(f"fine-tuning {args.init_from}", flush=True)
    else:
        pipe = model.build_pipeline(seed=args.seed)
    transformer = pipe.transformer
    n_params = sum(p.numel() for p in transformer.parameters())
    print(f"transformer parameters: {n_params}", flush=True)
    # the modules trained, by name (their parameters are trained, EMA-averaged and chosen together)
    trained = {"transformer": transformer}
    if args.train_text_encoders:
        trained.update(text_encoder=pipe.text_encoder, text_encoder_2=pipe.text_encoder_2)
        print(f"text encoder parameters: {sum(p.numel() for p in pipe.text_encoder.parameters())} + "
              f"{sum(p.numel() for p in pipe.text_encoder_2.parameters())} (trained)", flush=True)

    # ---- data: images -> latents, prompts -> embeddings (frozen encoders, computed once)
    t0 = time.time()
    images, prompt_idx, prompts, noise_stats = render_data(
        args.num_images, weights, args.seed, args.flip_relation_prob, args.swap_colors_prob, args.count_off_prob)
    if noise_stats:
        print(f"caption noise: {noise_stats}", flush=True)
    with torch.no_grad():
        latents = []
        for i in range(0, len(images), 2048):
            x = torch.from_numpy(images[i : i + 2048]).float() / 127.5 - 1.0
            z = pipe.vae.encode(x).latent_dist.mean
            latents.append((z - pipe.vae.config.shift_factor) * pipe.vae.config.scaling_factor)
        latents = torch.cat(latents)  # (N, 3, 16, 16)
        pe, _, pooled, _ = pipe.encode_prompt(
            prompts + [""], None, None, do_classifier_free_guidance=False,
            max_sequence_length=model.MAX_SEQUENCE_LENGTH,
        )  # (P + 1, 16 + MAX_SEQUENCE_LENGTH, 32), (P + 1, 64); last row = empty prompt
    empty = len(prompts)
    prompt_idx = torch.from_numpy(prompt_idx)
    print(f"rendered/encoded {len(images)} images with {len(prompts)} distinct captions in {time.time() - t0:.0f}s; "
          f"latents {tuple(latents.shape)} mean {latents.mean():.3f} std {latents.std():.3f}", flush=True)
    del images

    # ---- training
    for m in trained.values():
        m.train()
        m.requires_grad_(True)
    names = [f"{k}.{n}" for k, m in trained.items() for n, _ in m.named_parameters()]
    params = [p for m in trained.values() for p in m.parameters()]
    captions = prompts + [""]
    te_lr = args.lr if args.text_encoder_lr is None else args.text_encoder_lr
    groups = [{"params": list(m.parameters()), "peak_lr": args.lr if k == "transformer" else te_lr}
              for k, m in trained.items()]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    ema = [p.detach().clone() for p in params]
    gen = torch.Generator().manual_seed(args.seed + 1)

    def train_step(step, total):
        set_lr(opt, step, total, args.warmup)
        b = torch.randint(0, len(latents), (args.batch_size,), generator=gen)
        x0 = latents[b]
        pidx = prompt_idx[b].clone()
        pidx[torch.rand(args.batch_size, generator=gen) < args.empty_prompt_prob] = empty
        if args.train_text_encoders:  # (B, 16 + MAX_SEQUENCE_LENGTH, 32), (B, 64), with gradients
            enc, _, pool, _ = pipe.encode_prompt([captions[i] for i in pidx.tolist()], None, None,
                                                 do_classifier_free_guidance=False,
                                                 max_sequence_length=model.MAX_SEQUENCE_LENGTH)
        else:
            enc, pool = pe[pidx], pooled[pidx]
        t = torch.sigmoid(torch.randn(args.batch_size, generator=gen))  # logit-normal
        eps = torch.randn(x0.shape, generator=gen)
        tt = t.view(-1, 1, 1, 1)
        xt = (1 - tt) * x0 + tt * eps
        pred = transformer(
            hidden_states=xt, timestep=t * 1000, encoder_hidden_states=enc, pooled_projections=pool,
            return_dict=False,
        )[0]
        return optimizer_step(opt, params, ema, args.ema, torch.nn.functional.mse_loss(pred, eps - x0))

    total, losses, train_seconds = run_steps(train_step, args.steps, args.minutes, batch_size=args.batch_size,
                                             threads=args.threads, log_every=args.log_every,
                                             lr_now=lambda: opt.param_groups[0]["lr"])
    final_loss = float(np.mean(losses[-200:]))

    # ---- choose EMA / raw weights and the shift on a validation set (train prompts, fresh images)
    for m in trained.values():
        m.eval()
        m.requires_grad_(False)
    raw_params = [p.detach().clone() for p in params]
    weights_of = {"raw": raw_params, "ema": ema}

    def use(which):
        with torch.no_grad():
            for p, v in zip(params, weights_of[which]):
                p.copy_(v)

    if args.state:  # {name: tensor} of every trained parameter ("transformer.<name>", "text_encoder.<name>", ...)
        torch.save({w: dict(zip(names, [v.clone() for v in vals])) for w, vals in weights_of.items()}
                   | {"steps": total}, args.state)
    candidates = ["ema", "raw"] if args.save == "best" else [args.save]
    shifts = [float(s) for s in args.eval_shifts.split(",")]
    results = {}
    for which in candidates:
        use(which)
        for shift in shifts:
            pipe.scheduler = model.build_scheduler(shift)
            r = evaluate_pipeline(pipe, "train", args.eval_per_category, seed=1234,
                                  num_inference_steps=args.eval_steps, guidance_scale=args.eval_guidance)
            results[(which, shift)] = r
            print(f"validation ({which}, shift {shift}, guidance {args.eval_guidance}, {args.eval_steps} steps): "
                  f"strict {r['overall']['strict']:.3f} partial {r['overall']['partial']:.3f}", flush=True)
    which, shift = max(results, key=lambda k: (results[k]["overall"]["strict"], results[k]["overall"]["partial"]))
    use(which)
    pipe.scheduler = model.build_scheduler(shift)
    print(f"saving {which} weights with scheduler shift {shift} to {args.out}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    pipe.save_pretrained(args.out)

    # ---- final report on both splits (fresh seed), from the saved checkpoint
    saved = model.load_base_pipeline(path=args.out)
    report = {}
    for split in ("train", "test"):
        r = evaluate_pipeline(saved, split, args.eval_per_category, seed=0,
                              num_inference_steps=args.eval_steps, guidance_scale=args.eval_guidance)
        report[split] = r
        print(f"\n{split} prompts ({which} weights, shift {shift}, guidance {args.eval_guidance}, "
              f"{args.eval_steps} steps):\n{format_evaluation(r)}", flush=True)
    info = {
        "command": "python scripts/pretrain_shapes.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "steps": total,
        "init_from": args.init_from,
        "train_text_encoders": args.train_text_encoders,
        "text_encoder_lr": te_lr if args.train_text_encoders else None,
        "caption_noise": {"flip_relation_prob": args.flip_relation_prob, "swap_colors_prob": args.swap_colors_prob,
                          "count_off_prob": args.count_off_prob, "counts": noise_stats},
        "train_seconds": round(train_seconds, 1),
        "threads": args.threads,
        "final_loss_last200": round(final_loss, 4),
        "weights": which,
        "shift": shift,
        "guidance_scale": args.eval_guidance,
        "num_inference_steps": args.eval_steps,
        "max_sequence_length": model.MAX_SEQUENCE_LENGTH,
        "validation": {f"{w}_shift{s}": r["overall"] for (w, s), r in results.items()},
        "evaluation": report,
    }
    with open(os.path.join(args.out, "training_info.json"), "w") as f:
        json.dump(info, f, indent=1)
    print(f"total wall-clock {(time.time() - t_start) / 60:.1f} min", flush=True)


if __name__ == "__main__":
    main()
