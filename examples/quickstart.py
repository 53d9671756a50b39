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
  held-out test prompts of the same categories.

Measured here (seed 0, 30 iterations, 5.3 CPU-minutes on one thread): strict 0.431 -> 0.424, partial 0.651 -> 0.657
on the trained prompts; strict 0.417 -> 0.417, partial 0.614 -> 0.622 on the held-out prompts: no improvement beyond
noise at this budget (see docs/benchmarks.md, "The signal search"). Re-running starts over in ``--output_dir``.
"""

from __future__ import annotations

import argparse
import json
import os

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
    args = ap.parse_args(argv)
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
    trainer.train()
    after = {name: trainer.generate(p, seed=1234)[0] for name, (p, _) in sets.items()}
    trainer.save_model(args.output_dir)

    scores = {name: {"before": shapes.evaluate(before[name], *sets[name]), "after": shapes.evaluate(after[name], *sets[name])}
              for name in sets}
    with open(os.path.join(args.output_dir, "scores.json"), "w") as f:
        json.dump(scores, f, indent=2)
    # one row per distinct trained prompt (first of its 8 images), labelled with the prompt and its scores
    title = "strict accuracy, before -> after: " + ", ".join(
        f"{name.replace('_', ' ')} {scores[name]['before']['overall']['strict']:.3f} -> "
        f"{scores[name]['after']['overall']['strict']:.3f}" for name in sets)
    _save_before_after(before["trained_prompts"], after["trained_prompts"], sets["trained_prompts"][0],
                       os.path.join(args.output_dir, "before_after.png"), title)
    for name in sets:
        print(f"\n{name}, before training:\n" + shapes.reward.format_evaluation(scores[name]["before"]))
        print(f"{name}, after training:\n" + shapes.reward.format_evaluation(scores[name]["after"]))
    print(f"\nwrote {args.output_dir}/pytorch_lora_weights.safetensors, before_after.png, scores.json")


def _save_before_after(before, after, prompts, path, title="", max_rows=12):
    """One row per prompt: the prompt and both detector scores, then the image before and after training (same
    noise). Rows are the first ``max_rows`` distinct prompts."""
    from PIL import Image, ImageDraw

    size, text_w, head = 96, 300, 40
    rows = list(dict.fromkeys(prompts))[:max_rows]
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
