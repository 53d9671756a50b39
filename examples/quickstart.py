"""Quickstart: teach the committed tiny SD3 "shapes" model to draw the right number of shapes, with Flow-GRPO on CPU.

    python examples/quickstart.py                 # ~5-6 minutes of one core, with a progress bar
    python examples/quickstart.py --method op_grpo

It loads the base pipeline (a real ``StableDiffusion3Pipeline``, trained here on rendered shapes), trains a LoRA
on the task's single-object and counting prompts ("a red circle", "two blue squares") with the shapes detector's
partial score as the reward, and writes to ``--output_dir``:

- ``pytorch_lora_weights.safetensors``: the LoRA, loadable with ``pipe.load_lora_weights(output_dir)``;
- ``before_after.png``: one row per trained prompt, labelled with the prompt and its detector scores, the image
  before and after training (same noise);
- ``scores.json``: strict / partial accuracy before and after, on the trained prompts (8 images each) and on the
  held-out test prompts of the same categories, and under ``run`` the conditions (seed, iterations, threads, CPU
  time of the training, torch version, machine).

The README's measured numbers are :func:`readme_summary` of the committed run,
``benchmarks/results/quickstart/scores.json`` (``python examples/quickstart.py --summary FILE`` prints that
sentence for any scores.json; tests/test_docs.py checks the README against the committed file). Results are
reproducible for a given seed and thread count on one machine kind; another thread count changes float summation
order (about 2e-6 in the LoRA after 2 iterations), which grows over 30 iterations. Re-running starts over in
``--output_dir`` (the earlier run's files there are removed).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from trl_flow import FlowGRPOConfig, FlowGRPOTrainer, OPGRPOConfig, OPGRPOTrainer
from trl_flow.tasks import shapes


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", choices=["flow_grpo", "op_grpo"], default="flow_grpo")
    ap.add_argument("--steps", type=int, default=30, help="training iterations")
    ap.add_argument("--output_dir", default="out/quickstart")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--images_per_prompt", type=int, default=8, help="evaluation images per prompt (same noise before/after)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (the tiny model's ops are too small to gain from more; 1 is fastest here)")
    ap.add_argument("--summary", metavar="SCORES_JSON",
                    help="print the README's sentence for this scores.json and exit (no training)")
    args = ap.parse_args(argv)
    if args.summary:
        with open(args.summary, encoding="utf-8") as f:
            print(readme_summary(json.load(f)))
        return
    torch.set_num_threads(args.threads)

    torch.manual_seed(args.seed)
    pipe = shapes.load_base_pipeline()
    config_cls, trainer_cls = (FlowGRPOConfig, FlowGRPOTrainer) if args.method == "flow_grpo" else (
        OPGRPOConfig, OPGRPOTrainer)
    config = config_cls(
        output_dir=args.output_dir, overwrite_output_dir=True, seed=args.seed, max_steps=args.steps,
        height=32, width=32, num_inference_steps=10, guidance_scale=shapes.DEFAULT_GUIDANCE_SCALE,
        max_sequence_length=shapes.MAX_SEQUENCE_LENGTH, eval_num_inference_steps=shapes.DEFAULT_NUM_INFERENCE_STEPS,
        num_generations=16, prompts_per_step=8, per_device_train_batch_size=32, learning_rate=1e-3,
        clip_range=1e-3, beta=0.01, lora_r=16, lora_alpha=32, per_device_eval_batch_size=200,
    )
    categories = ("single", "counting")
    train = shapes.train_prompts().filter(lambda r: r["category"] in categories)
    test = shapes.test_prompts().filter(lambda r: r["category"] in categories)
    trainer = trainer_cls(config, pipe, [shapes.shapes_partial_reward], train_dataset=train)

    n = args.images_per_prompt
    sets = {name: ([p for p in ds["prompt"] for _ in range(n)], [c for c in ds["category"] for _ in range(n)])
            for name, ds in (("trained_prompts", train), ("held_out_prompts", test))}
    before = {name: trainer.generate(p, seed=1234)[0] for name, (p, _) in sets.items()}
    cpu0, wall0 = time.process_time(), time.perf_counter()
    trainer.train()
    cpu_s, wall_s = time.process_time() - cpu0, time.perf_counter() - wall0
    after = {name: trainer.generate(p, seed=1234)[0] for name, (p, _) in sets.items()}
    trainer.save_model(args.output_dir)

    scores = {name: {"before": shapes.evaluate(before[name], *sets[name]), "after": shapes.evaluate(after[name], *sets[name])}
              for name in sets}
    scores["run"] = {"method": args.method, "seed": args.seed, "steps": args.steps, "threads": args.threads,
                     "images_per_prompt": n, "train_cpu_s": round(cpu_s, 1), "train_wall_s": round(wall_s, 1),
                     "torch": torch.__version__, "machine": f"{platform.machine()}, {os.cpu_count()} cores"}
    with open(os.path.join(args.output_dir, "scores.json"), "w") as f:
        json.dump(scores, f, indent=2)
    # one row per distinct trained prompt (first of its 8 images), labelled with the prompt and its scores
    title = "strict accuracy, before -> after: " + ", ".join(
        f"{name.replace('_', ' ')} {scores[name]['before']['overall']['strict']:.3f} -> "
        f"{scores[name]['after']['overall']['strict']:.3f}" for name in sets)
    _save_before_after(before["trained_prompts"], after["trained_prompts"], sets["trained_prompts"][0],
                       os.path.join(args.output_dir, "before_after.png"), title)
    print("\n" + readme_summary(scores))
    for name in sets:
        print(f"\n{name}, before training:\n" + shapes.reward.format_evaluation(scores[name]["before"]))
        print(f"{name}, after training:\n" + shapes.reward.format_evaluation(scores[name]["after"]))
    print(f"\nwrote {args.output_dir}/pytorch_lora_weights.safetensors, before_after.png, scores.json")


def readme_summary(scores: dict) -> str:
    """The README's "Measured here ..." sentence for a quickstart ``scores.json`` (its numbers, never typed)."""
    run = scores["run"]
    threads = "one thread" if run["threads"] == 1 else f"{run['threads']} threads"

    def part(split):
        b, a = scores[split]["before"]["overall"], scores[split]["after"]["overall"]
        return (f"strict {b['strict']:.3f} -> {a['strict']:.3f} and partial {b['partial']:.3f} -> {a['partial']:.3f}",
                a["n"])

    (trained, n_tr), (held, n_ho) = part("trained_prompts"), part("held_out_prompts")
    return (f"Measured here with seed {run['seed']} ({run['steps']} iterations, {run['train_cpu_s'] / 60:.1f} "
            f"CPU-minutes on {threads}): {trained} on the trained prompts ({n_tr} images), {held} on the held-out "
            f"prompts ({n_ho} images)")


def _save_before_after(before, after, prompts, path, title="", max_rows=None):
    """One row per prompt: the prompt and both detector scores, then the image before and after training (same
    noise). Rows are every distinct prompt (the first ``max_rows`` if given)."""
    from PIL import Image, ImageDraw

    size, text_w, head = 96, 300, 40
    rows = list(dict.fromkeys(prompts))[:max_rows]  # max_rows=None: all
    sheet = Image.new("RGB", (text_w + 2 * size + 12, head + len(rows) * (size + 4)), (255, 255, 255))
    draw = ImageDraw.Draw(sheet)
    draw.text((6, 4), title, fill=(0, 0, 0))
    draw.text((text_w, 24), "before", fill=(0, 0, 0))
    draw.text((text_w + size + 8, 24), "after", fill=(0, 0, 0))

    def pil(t):
        arr = (t.clamp(0, 1).permute(1, 2, 0).numpy() * 255).round().astype("uint8")
        return Image.fromarray(arr).resize((size, size), Image.NEAREST)

    for r, prompt in enumerate(rows):
        i = prompts.index(prompt)
        y = head + r * (size + 4)
        sb, sa = shapes.score(before[i], prompt), shapes.score(after[i], prompt)
        draw.text((6, y + 30), f'"{prompt}"', fill=(0, 0, 0))
        draw.text((6, y + 48), f"partial {sb['partial']:.2f} -> {sa['partial']:.2f}   "
                               f"strict {sb['strict']:.0f} -> {sa['strict']:.0f}", fill=(90, 90, 90))
        sheet.paste(pil(before[i]), (text_w, y))
        sheet.paste(pil(after[i]), (text_w + size + 8, y))
    sheet.save(path)


if __name__ == "__main__":
    main()
