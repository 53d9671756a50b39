#!/usr/bin/env python
"""Measures the editing base's strict / partial edit success per instruction (the table the editing tier's
instructions are chosen from, ``benchmarks/shapes.py``'s ``edit_tier_instructions``).

    OMP_NUM_THREADS=1 python scripts/measure_shapes_edit_base.py --out benchmarks/results/shapes_edit_base

Every instruction of the grammar (train and held-out) on ``--scenes`` fresh scenes each (scene and noise seed
``--seed``), sampled by the pipeline itself at 10 steps (``shapes.edit_generate``), scored by the ``shapes_edit``
detector. Writes ``per_instruction.json``: ``{"per_instruction": [{"instruction", "split", "kind", "strict",
"partial", "n"}, ...], ...}``.
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
from trl_flow.tasks.shapes.edit_reward import edit_score  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="benchmarks/results/shapes_edit_base")
    p.add_argument("--base", default=None, help="a pretrain_shapes_edit.py folder (default: the committed base)")
    p.add_argument("--scenes", type=int, default=64)
    p.add_argument("--seed", type=int, default=4321)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.process_time()
    pipe = model_edit.load_edit_base_pipeline(path=args.base)
    texts = edit.train_instructions() + edit.test_instructions()
    rows = edit.edit_rows([t for t in texts for _ in range(args.scenes)], len(texts) * args.scenes, args.seed)
    images = model_edit.edit_generate(pipe, rows["prompt"], rows["source_image"], seed=args.seed)
    sources = torch.stack([torch.from_numpy(np.array(s)).permute(2, 0, 1).float() / 255 for s in rows["source_image"]])
    table = []
    for k, text in enumerate(texts):
        sl = range(k * args.scenes, (k + 1) * args.scenes)
        scores = [edit_score(images[i], sources[i], text) for i in sl]
        table.append({"instruction": text, "split": "test" if edit.is_test_instruction(text) else "train",
                      "kind": edit.parse_instruction(text).kind, "n": args.scenes,
                      "strict": float(np.mean([s["strict"] for s in scores])),
                      "partial": float(np.mean([s["partial"] for s in scores]))})
        print(f"{table[-1]['split']:5s} {text:32s} strict {table[-1]['strict']:.3f} "
              f"partial {table[-1]['partial']:.3f}")
    os.makedirs(args.out, exist_ok=True)
    info = {"command": "python scripts/measure_shapes_edit_base.py "
                       + " ".join(argv if argv is not None else sys.argv[1:]),
            "base": args.base or "committed edit_base_model", "scenes": args.scenes, "seed": args.seed,
            "num_inference_steps": model_edit.EDIT_NUM_INFERENCE_STEPS, "cpu_s": round(time.process_time() - t0, 1),
            "per_instruction": table}
    with open(os.path.join(args.out, "per_instruction.json"), "w") as f:
        json.dump(info, f, indent=1)


if __name__ == "__main__":
    main()
