"""How a shapes base's text encoders tell a relation from its opposite: for every pair of train position prompts
that differ only in the relation ("... to the left of ..." / "... to the right of ...", "above" / "below"), the
difference of their embeddings as the transformer receives them (``pipe.encode_prompt``).

    OMP_NUM_THREADS=1 python benchmarks/shapes_text_encoders.py --bases noisy
    benchmarks/results/shapes_tier3_te/base_model

Per base and per embedding (``token``: the (16 + 1, 32) token states, flattened; ``pooled``: the (64,) pooled one):
- ``relative_difference``: mean over pairs of ``|e(a) - e(b)| / |e(a)|``, how far apart the two relations are;
- ``direction_cosine``: mean cosine between the difference vectors of two different pairs, how much the relation is
  one shared direction across prompts (1: the same direction for every pair of objects).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from trl_flow.tasks.shapes import grammar, model  # noqa: E402

OPPOSITE = {"to the left of": "to the right of", "above": "below"}


def relation_pairs() -> list[tuple[str, str]]:
    ds = grammar.train_prompts()
    pos = {p for p, c in zip(ds["prompt"], ds["category"]) if c == "position"}
    return sorted((p, p.replace(a, b)) for p in pos for a, b in OPPOSITE.items() if a in p and p.replace(a, b) in pos)


@torch.no_grad()
def measure(pipe, pairs) -> dict:
    out = {}
    enc = [pipe.encode_prompt([p[i] for p in pairs], None, None, do_classifier_free_guidance=False,
                              max_sequence_length=model.MAX_SEQUENCE_LENGTH) for i in (0, 1)]
    for key, j in (("token", 0), ("pooled", 2)):
        a, b = enc[0][j].flatten(1).double(), enc[1][j].flatten(1).double()
        d = a - b
        dn = torch.nn.functional.normalize(d, dim=1)
        cos = dn @ dn.T
        off = cos[~torch.eye(len(d), dtype=torch.bool)]
        out[key] = {"relative_difference": round(float((d.norm(dim=1) / a.norm(dim=1)).mean()), 4),
                    "direction_cosine": round(float(off.mean()), 4)}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bases", nargs="+", default=["clean", "noisy"],
                    help="committed variants (clean, noisy) or save_pretrained folders")
    ap.add_argument("--out", default=None, help="optional JSON file")
    args = ap.parse_args(argv)
    pairs = relation_pairs()
    res = {"pairs": len(pairs), "bases": {b: measure(model.load_base_pipeline(variant=b), pairs) for b in args.bases}}
    print(json.dumps(res, indent=1))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
