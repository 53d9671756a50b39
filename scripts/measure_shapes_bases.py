#!/usr/bin/env python
"""Measures the committed shapes base models with the detector (the numbers of docs/shapes.md).

    python scripts/measure_shapes_bases.py --out /tmp/shapes_bases.json

For each base variant (``shapes.load_base_pipeline(variant=...)``), ODE sampling (the checkpoint's scheduler),
20 steps, guidance 3, ``max_sequence_length=1``:

1. strict / partial accuracy per category on 40 prompts per category (drawn with replacement, seeded) of the
   train, val and test splits, one image each;
2. RL signal: per category, up to 16 train prompts x 8 draws (fresh noise per draw): the share of groups of 8
   whose strict outcomes are mixed (not all equal), and the mean within-group std of strict;
3. the detector's shape features (fill ratio, corner occupancy) of the components whose intended shape is known
   (an object whose colour is unique in its prompt, count 1, and exactly one component of that colour found),
   per intended shape, with the share read as each shape;
4. for position prompts whose objects differ in colour: the colour-level relation accuracy (largest component
   of each colour, shapes ignored) and, in the groups of 8, the share of groups with mixed relation outcomes;
5. why position samples fail strict (``reward.failure_kind``: count, colour, shape, or the relation alone) on
   ``--position-draws`` seeded draws of the val and test position prompts: the relation-only share is what a
   model that fixes only the relation can gain.

``--variants`` takes committed variants and ``save_pretrained`` folders (``clean,noisy,path/to/base_model``).
Rendered ground truth (after the VAE round trip) is measured the same way for reference.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from trl_flow.tasks.shapes import grammar, model, reward  # noqa: E402
from trl_flow.tasks.shapes.render import render_batch  # noqa: E402


def pick(ds, per_category, seed):
    rng = np.random.default_rng(seed)
    prompts, cats = [], []
    for cat in grammar.CATEGORIES:
        pool = [p for p, c in zip(ds["prompt"], ds["category"]) if c == cat]
        if pool:
            prompts += [pool[i] for i in rng.integers(0, len(pool), per_category)]
            cats += [cat] * per_category
    return prompts, cats


def shape_features(images, prompts):
    """[(intended shape, fill, corner, read shape)] for the components whose intended shape is known."""
    rows = []
    for img, p in zip(images, prompts):
        spec = grammar.parse_prompt(p)
        min_pixels, comps = reward.colored_components(img, corners=True)
        comps = [c for c in comps if c[1] >= min_pixels]
        for o in spec.objects:
            if o.count != 1 or sum(x.color == o.color for x in spec.objects) != 1:
                continue
            mine = [c for c in comps if c[0] == o.color]
            if len(mine) != 1:
                continue
            _, area, (x0, y0, x1, y1), corner = mine[0]
            w, h = x1 - x0 + 1, y1 - y0 + 1
            rows.append((o.shape, area / (w * h), corner, reward.classify_shape(area, w, h, corner)))
    return rows


def summarize_features(rows):
    out = {}
    for s in grammar.SHAPES:
        sel = [r for r in rows if r[0] == s]
        if not sel:
            continue
        q = [0.1, 0.25, 0.5, 0.75, 0.9]
        out[s] = {
            "n": len(sel),
            "fill_quantiles_10_25_50_75_90": [round(float(v), 3) for v in np.quantile([r[1] for r in sel], q)],
            "corner_quantiles_10_25_50_75_90": [round(float(v), 3) for v in np.quantile([r[2] for r in sel], q)],
            "corner_min_max": [round(float(min(r[2] for r in sel)), 3), round(float(max(r[2] for r in sel)), 3)],
            "fill_min_max": [round(float(min(r[1] for r in sel)), 3), round(float(max(r[1] for r in sel)), 3)],
            "read_as": {t: round(float(np.mean([r[3] == t for r in sel])), 3) for t in grammar.SHAPES + ("other",)},
        }
    return out


def position_failures(pipe, ds, n: int, seed: int = 1234) -> dict:
    """``kinds``: the shares of ``reward.FAILURE_KINDS`` on ``n`` seeded draws (with replacement) of the position
    prompts of ``ds``, one image each, with the colour-level relation accuracy of the same images."""
    pool = [p for p, c in zip(ds["prompt"], ds["category"]) if c == "position"]
    prompts = [pool[i] for i in np.random.default_rng(seed).integers(0, len(pool), n)]
    images = model.generate(pipe, prompts, seed=seed)
    kinds, relation = [], []
    for img, p in zip(images, prompts):
        objects = reward.detect(img)
        kinds.append(reward.failure_kind(objects, p))
        r = reward.colour_relation_holds(img, p, objects=objects)
        relation += [] if r is None else [r]
    return {"kinds": {k: kinds.count(k) / n for k in reward.FAILURE_KINDS}, "n": n,
            "relation": float(np.mean(relation)), "n_relation": len(relation)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="clean,noisy",
                    help="comma-separated committed variants (clean, noisy) or save_pretrained folders")
    ap.add_argument("--position-draws", type=int, default=400,
                    help="draws of the val and test position prompts for the failure breakdown (5.)")
    ap.add_argument("--per-category", type=int, default=40)
    ap.add_argument("--group-prompts", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = {"settings": {"sampler": "ODE (FlowMatchEuler, the checkpoint's shift)", "steps": 20, "guidance": 3.0,
                           "max_sequence_length": model.MAX_SEQUENCE_LENGTH, **vars(args)}}
    rng = np.random.default_rng(0)
    allp = [p for p, _ in grammar.all_prompts()]
    gt_prompts = [allp[i] for i in rng.integers(0, len(allp), 1000)]
    gt = render_batch(gt_prompts, rng=1)  # drawn on the VAE's 2x2 grid: identical after the round trip
    with torch.no_grad():
        vae = model.build_vae()
        gt = ((vae.decode(vae.encode(gt * 2 - 1).latent_dist.mean).sample + 1) / 2).clamp(0, 1)
    result["renders_after_vae"] = {"features": summarize_features(shape_features(gt, gt_prompts)),
                                   "strict": float(np.mean(reward.shapes_strict_reward(gt, gt_prompts)))}
    print("renders", json.dumps(result["renders_after_vae"]), flush=True)
    splits = {"train": grammar.train_prompts(), "val": grammar.val_prompts(), "test": grammar.test_prompts()}
    for variant in args.variants.split(","):
        pipe = model.load_base_pipeline(variant=variant)  # a variant name or a save_pretrained folder
        res = {"accuracy": {}, "relation": {}, "groups": {}, "position_failures": {}}
        feat_rows = []
        for split, ds in splits.items():
            prompts, cats = pick(ds, args.per_category, seed=0)
            images = model.generate(pipe, prompts, seed=0)
            res["accuracy"][split] = acc = reward.evaluate(images, prompts, cats)  # one detection per image
            res["relation"][split] = {"acc": acc["overall"]["relation"], "n": acc["overall"]["n_relation"]}
            feat_rows += shape_features(images, prompts)
            print(variant, split, "colour-level relation", res["relation"][split], "\n"
                  + reward.format_evaluation(res["accuracy"][split]), flush=True)
        for split in ("val", "test"):
            res["position_failures"][split] = failures = position_failures(pipe, splits[split], args.position_draws)
            print(variant, split, "position failures", failures, flush=True)
        train = splits["train"]
        g_rng = np.random.default_rng(1)
        for cat in grammar.CATEGORIES:
            pool = [p for p, c in zip(train["prompt"], train["category"]) if c == cat]
            chosen = [pool[i] for i in g_rng.permutation(len(pool))[: args.group_prompts]]
            prompts = [p for p in chosen for _ in range(args.group_size)]
            images = model.generate(pipe, prompts, seed=100 + grammar.CATEGORIES.index(cat))
            objects = [reward.detect(img) for img in images]  # one detection serves strict and the relation
            strict = np.array(
                [all(reward.constraints_met(o, grammar.parse_prompt(p))) for o, p in zip(objects, prompts)], float)
            strict = strict.reshape(len(chosen), args.group_size)
            feat_rows += shape_features(images, prompts)
            if cat == "position":
                rel = np.array([reward.colour_relation_holds(img, p, objects=o)
                                for img, p, o in zip(images, prompts, objects)], dtype=object)
                rel = rel.reshape(len(chosen), args.group_size)
                keep = [i for i in range(len(chosen)) if all(v is not None for v in rel[i])]
                r = rel[keep].astype(float)
                res["relation_groups"] = {"n_groups": len(keep), "relation_acc": float(r.mean()),
                                          "mixed_share": float(np.mean(r.min(1) != r.max(1))),
                                          "mean_within_std": float(r.std(1).mean())}
                print(variant, "relation (colour level)", res["relation_groups"], flush=True)
            res["groups"][cat] = {
                "n_groups": len(chosen),
                "mixed_share": float(np.mean(strict.min(1) != strict.max(1))),
                "mean_within_std": float(strict.std(1).mean()),
                "strict": float(strict.mean()),
            }
            print(variant, cat, res["groups"][cat], flush=True)
        res["features"] = summarize_features(feat_rows)
        print(variant, "features", json.dumps(res["features"]), flush=True)
        result[variant] = res
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
