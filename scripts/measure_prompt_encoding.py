"""Text-encoder calls and rows of one iteration's prompt encoding, deduplicated (the trainer's) vs the former path
(every sample's prompt, in chunks of per_device_train_batch_size), on the tiny pipelines; with the encode time ratio.

    python scripts/measure_prompt_encoding.py [--prompts_per_step 8] [--num_generations 16] [--batch 8]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from trl_flow import FlowGRPOConfig, FlowGRPOTrainer, editing, testing
from trl_flow.models import cat_embeds


def former_encode(tr, prompts, gs, columns):
    bs = tr.config.per_device_train_batch_size
    parts = []
    with torch.no_grad(), tr._autocast():
        for i in range(0, len(prompts), bs):
            images = editing.adapter_images(tr.adapter, {k: v[i : i + bs] for k, v in (columns or {}).items()})
            parts.append(tr.adapter.encode_prompts(prompts[i : i + bs], gs > 1, tr.config.max_sequence_length,
                                                   **({} if images is None else {"images": images})))
    return cat_embeds(parts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts_per_step", type=int, default=8)
    ap.add_argument("--num_generations", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    prompts = [f"a {c} cat {i}" for i, c in enumerate(["red", "blue", "green", "tiny"] * 16)]
    for family, build, msl in (("sd3", testing.tiny_sd3_pipeline, 16), ("flux2", testing.tiny_flux2_pipeline, 40)):
        pipe = build()
        calls = {n: [] for n, m in pipe.components.items() if n.startswith("text_encoder") and m is not None}
        for n in calls:
            pipe.components[n].register_forward_pre_hook(
                lambda m, a, kw, n=n: calls[n].append(int(kw.get("input_ids", a[0] if a else None).shape[0])),
                with_kwargs=True)
        config = FlowGRPOConfig(output_dir=tempfile.mkdtemp(), prompts_per_step=args.prompts_per_step,
                                num_generations=args.num_generations, per_device_train_batch_size=args.batch,
                                height=32, width=32, max_sequence_length=msl, guidance_scale=1.0)
        tr = FlowGRPOTrainer(config, pipe, [lambda im, p, **k: im.mean(dim=(1, 2, 3))], train_dataset=prompts)
        ps, cols, _ = tr.sample_prompts(0)
        result = {}
        new, old = tr.encode(ps, 1.0, cols), former_encode(tr, ps, 1.0, cols)
        print(f"{family}: embeddings equal the former path's: {all(torch.equal(new[k], old[k]) for k in old)}")
        for name, fn in (("deduplicated", lambda: tr.encode(ps, 1.0, cols)),
                         ("former", lambda: former_encode(tr, ps, 1.0, cols))):
            for c in calls.values():
                c.clear()
            fn()
            counted = {n: (len(c), sum(c)) for n, c in calls.items()}
            t = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                fn()
                t.append(time.perf_counter() - t0)
            result[name] = (counted, min(t))
            print(f"{family} {name}: {len(ps)} samples; per text encoder (calls, rows) {counted}; "
                  f"encode {min(t) * 1000:.1f} ms", flush=True)
        print(f"{family}: former / deduplicated encode time = {result['former'][1] / result['deduplicated'][1]:.1f}x",
              flush=True)


if __name__ == "__main__":
    main()
