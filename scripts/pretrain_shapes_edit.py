#!/usr/bin/env python
"""Pretrains the base editing pipeline of the shapes task (a tiny FluxKontextPipeline) on CPU.

    OMP_NUM_THREADS=1 python scripts/pretrain_shapes_edit.py --minutes 20 --out trl_flow/tasks/shapes/edit_base_model

``--init-from DIR`` continues an existing ``save_pretrained`` editing pipeline (its VAE and text encoders kept).

1. Renders ``--num-pairs`` (source, instruction, target) triples of the TRAIN instructions (held-out instructions
   are never used; ``trl_flow.tasks.shapes.edit``), encodes sources and targets with the hand-set VAE (latents
   (N, 3, 16, 16)) and the instructions with the frozen text encoders (once).
2. Trains the ``FluxTransformer2DModel`` with rectified flow, the recipe of ``scripts/pretrain_shapes.py``:
   x_t = (1 - t) x0 + t eps on the target latents, target eps - x0, logit-normal t, the source's packed tokens
   appended after the noisy tokens with the pipeline's ids (first coordinate 1), only the generated tokens' velocity
   in the loss; AdamW (0.9, 0.99), clip 1, warm-up then cosine decay to 0, EMA. The number of steps is fixed up
   front: ``--steps``, or measured from ``--minutes`` after a short timing run (printed, so ``--steps N`` repeats a
   run).
3. Evaluates EMA and raw weights on fresh scenes of the train instructions (``--save best``: the higher strict edit
   success; ``ema`` / ``raw`` to fix it), saves the pipeline with ``save_pretrained`` and reports strict / partial
   edit success (detector reward ``shapes_edit``) on fresh scenes of the train and held-out instructions, sampled
   by the saved pipeline itself (``pipe(image=..., prompt=...)``), in ``training_info.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from trl_flow.tasks.shapes import edit, model_edit  # noqa: E402
from trl_flow.tasks.shapes.edit_reward import evaluate_edits  # noqa: E402
from trl_flow.tasks.shapes.pretraining import optimizer_step, run_steps, set_lr  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=model_edit.EDIT_BASE_MODEL_DIR, help="where save_pretrained writes the pipeline")
    p.add_argument("--minutes", type=float, default=20.0, help="training wall-clock budget (sets --steps)")
    p.add_argument("--steps", type=int, default=None, help="number of optimizer steps (overrides --minutes)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--ema", type=float, default=0.999)
    p.add_argument("--num-pairs", type=int, default=40_000)
    p.add_argument("--eval-per-split", type=int, default=256, help="edited images per split in the evaluations")
    p.add_argument("--eval-steps", type=int, default=model_edit.EDIT_NUM_INFERENCE_STEPS)
    p.add_argument("--save", choices=["best", "ema", "raw"], default="best")
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--init-from", default=None,
                   help="continue from a save_pretrained editing pipeline (e.g. "
                        "trl_flow/tasks/shapes/edit_base_model) instead of a fresh transformer; its VAE and text "
                        "encoders are kept. Use another --seed than the run it continues, so that the rendered pairs "
                        "are new")
    return p.parse_args(argv)


def encode_images(pipe, images: np.ndarray) -> torch.Tensor:
    """uint8 (N, 3, 32, 32) -> VAE latents (N, 3, 16, 16), shifted and scaled as the pipeline's
    ``_encode_vae_image``."""
    out = []
    with torch.no_grad():
        for i in range(0, len(images), 2048):
            x = torch.from_numpy(images[i: i + 2048]).float() / 127.5 - 1.0
            z = pipe.vae.encode(x).latent_dist.mode()
            out.append((z - pipe.vae.config.shift_factor) * pipe.vae.config.scaling_factor)
    return torch.cat(out)


def evaluate(pipe, split: str, n: int, seed: int, steps: int) -> dict:
    """Strict / partial edit success of ``pipe`` on ``n`` fresh scenes of the split's instructions."""
    instructions = edit.train_instructions() if split == "train" else edit.test_instructions()
    rows = edit.edit_rows(instructions, n, seed)
    images = model_edit.edit_generate(pipe, rows["prompt"], rows["source_image"], seed=seed, num_inference_steps=steps)
    sources = torch.stack([torch.from_numpy(np.array(s)).permute(2, 0, 1).float() / 255 for s in rows["source_image"]])
    return evaluate_edits(images, rows["prompt"], sources)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t_start = time.time()
    print(f"args: {vars(args)}", flush=True)
    if args.init_from:
        pipe = model_edit.load_edit_base_pipeline(path=args.init_from)
        print(f"continuing from {args.init_from}", flush=True)
    else:
        pipe = model_edit.build_edit_pipeline(seed=args.seed)
    transformer = pipe.transformer
    print(f"transformer parameters: {sum(p.numel() for p in transformer.parameters())}", flush=True)

    # ---- data
    t0 = time.time()
    instructions = edit.train_instructions()
    rng = np.random.default_rng(args.seed)
    idx = rng.integers(0, len(instructions), args.num_pairs)
    pairs = [edit.render_pair(instructions[i], rng) for i in idx]
    src_lat = encode_images(pipe, np.stack([p[0] for p in pairs]))
    tgt_lat = encode_images(pipe, np.stack([p[1] for p in pairs]))
    del pairs
    with torch.no_grad():
        pe, pooled, _ = pipe.encode_prompt(instructions, None, max_sequence_length=model_edit.EDIT_MAX_SEQUENCE_LENGTH)
    idx = torch.from_numpy(idx)
    b, c, h, w = src_lat.shape
    src_tok = pipe._pack_latents(src_lat, b, c, h, w)  # (N, 64, 12)
    tgt_tok = pipe._pack_latents(tgt_lat, b, c, h, w)
    n_tok = src_tok.shape[1]
    img_ids = pipe._prepare_latent_image_ids(1, h // 2, w // 2, "cpu", torch.float32)
    cond_ids = img_ids.clone()
    cond_ids[:, 0] = 1
    ids = torch.cat([img_ids, cond_ids])
    txt_ids = torch.zeros(pe.shape[1], 3)
    print(f"rendered/encoded {b} pairs of {len(instructions)} train instructions in {time.time() - t0:.0f}s; "
          f"tokens {tuple(tgt_tok.shape)}", flush=True)

    # ---- training
    transformer.train()
    transformer.requires_grad_(True)
    params = list(transformer.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    ema = [p.detach().clone() for p in params]
    gen = torch.Generator().manual_seed(args.seed + 1)

    def train_step(step, total):
        set_lr(opt, step, total, args.warmup)
        sel = torch.randint(0, b, (args.batch_size,), generator=gen)
        x0, cond, k = tgt_tok[sel], src_tok[sel], idx[sel]
        t = torch.sigmoid(torch.randn(args.batch_size, generator=gen))  # logit-normal
        eps = torch.randn(x0.shape, generator=gen)
        xt = (1 - t.view(-1, 1, 1)) * x0 + t.view(-1, 1, 1) * eps
        pred = transformer(hidden_states=torch.cat([xt, cond], 1), timestep=t, guidance=None,
                           pooled_projections=pooled[k], encoder_hidden_states=pe[k], txt_ids=txt_ids, img_ids=ids,
                           return_dict=False)[0][:, :n_tok]
        return optimizer_step(opt, params, ema, args.ema, torch.nn.functional.mse_loss(pred, eps - x0))

    total, losses, train_seconds = run_steps(train_step, args.steps, args.minutes, batch_size=args.batch_size,
                                             threads=args.threads, log_every=args.log_every,
                                             lr_now=lambda: opt.param_groups[0]["lr"])
    final_loss = float(np.mean(losses[-200:]))

    # ---- choose EMA / raw weights on fresh scenes of the train instructions
    transformer.eval()
    transformer.requires_grad_(False)
    weights_of = {"raw": [p.detach().clone() for p in params], "ema": ema}

    def use(which):
        with torch.no_grad():
            for p, v in zip(params, weights_of[which]):
                p.copy_(v)

    results = {}
    for which in (["ema", "raw"] if args.save == "best" else [args.save]):
        use(which)
        results[which] = evaluate(pipe, "train", args.eval_per_split, seed=1234, steps=args.eval_steps)
        print(f"validation ({which}): {results[which]['overall']}", flush=True)
    which = max(results, key=lambda k: (results[k]["overall"]["strict"], results[k]["overall"]["partial"]))
    use(which)
    print(f"saving {which} weights to {args.out}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    pipe.save_pretrained(args.out)

    # ---- final report on both splits (fresh scenes and noise), from the saved checkpoint
    saved = model_edit.load_edit_base_pipeline(path=args.out)
    report = {}
    for split in ("train", "test"):
        report[split] = evaluate(saved, split, args.eval_per_split, seed=0, steps=args.eval_steps)
        print(f"{split} instructions ({which} weights): " + json.dumps(report[split]), flush=True)
    info = {
        "command": "python scripts/pretrain_shapes_edit.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "steps": total, "init_from": args.init_from, "seed": args.seed, "batch_size": args.batch_size, "lr": args.lr,
        "num_pairs": args.num_pairs,
        "train_seconds": round(train_seconds, 1), "train_minutes": round(train_seconds / 60, 2),
        "threads": args.threads, "final_loss_last200": round(final_loss, 4), "weights": which,
        "num_inference_steps": args.eval_steps, "max_sequence_length": model_edit.EDIT_MAX_SEQUENCE_LENGTH,
        "evaluation_note": f"{args.eval_per_split} fresh scenes per split (scene/noise seed 0), strict / partial of "
                           "the shapes_edit detector; validation: scene/noise seed 1234 on train instructions",
        "validation": {w: r["overall"] for w, r in results.items()},
        "evaluation": report,
        "train_instructions": edit.train_instructions(), "test_instructions": edit.test_instructions(),
    }
    if args.init_from:  # the history of the weights continued: the record of the run that made them, if any
        prior = os.path.join(args.init_from, "training_info.json")
        info["init_from_training_info"] = json.load(open(prior)) if os.path.exists(prior) else None
    with open(os.path.join(args.out, "training_info.json"), "w") as f:
        json.dump(info, f, indent=1)
    print(f"total wall-clock {(time.time() - t_start) / 60:.1f} min", flush=True)


if __name__ == "__main__":
    main()
