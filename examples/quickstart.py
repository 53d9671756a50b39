"""Quickstart: teach the committed tiny SD3 "shapes" model to draw the right number of shapes, with Flow-GRPO on CPU.

    python examples/quickstart.py                 # ~3-5 minutes on 2 cores
    python examples/quickstart.py --method op_grpo

It loads the base pipeline (a real ``StableDiffusion3Pipeline``, trained here on rendered shapes), trains a LoRA
on the task's single-object and counting prompts ("a red circle", "two blue squares") with the shapes detector's
partial score as the reward, and writes to ``--output_dir``:

- ``pytorch_lora_weights.safetensors``: the LoRA, loadable with ``pipe.load_lora_weights(output_dir)``;
- ``before_after.png``: the same prompts and noise before (top rows) and after (bottom rows) training;
- ``scores.json``: strict / partial accuracy before and after, on the trained prompts (8 images each) and on the
  held-out test prompts of the same categories.

Measured here (seed 0, 30 iterations, 4.5 min on one thread): strict 0.431 -> 0.486, partial 0.651 -> 0.696 on
the trained prompts; on the held-out prompts of the same categories strict 0.417 -> 0.375 (72 images: within noise,
no generalisation at this budget).
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
    args = ap.parse_args(argv)

    torch.manual_seed(args.seed)
    pipe = shapes.load_base_pipeline()
    config_cls, trainer_cls = (FlowGRPOConfig, FlowGRPOTrainer) if args.method == "flow_grpo" else (
        OPGRPOConfig, OPGRPOTrainer)
    config = config_cls(
        output_dir=args.output_dir, seed=args.seed, max_steps=args.steps,
        height=32, width=32, num_inference_steps=10, guidance_scale=shapes.DEFAULT_GUIDANCE_SCALE,
        max_sequence_length=shapes.MAX_SEQUENCE_LENGTH, eval_num_inference_steps=shapes.DEFAULT_NUM_INFERENCE_STEPS,
        num_generations=16, prompts_per_step=8, per_device_train_batch_size=32, learning_rate=1e-3,
        clip_range=1e-3, beta=0.01, lora_r=16, lora_alpha=32, per_device_eval_batch_size=200,
    )
    categories = ("single", "counting")
    train = shapes.train_prompts().filter(lambda r: r["category"] in categories)
    test = shapes.test_prompts().filter(lambda r: r["category"] in categories)
    trainer = trainer_cls(config, pipe, [shapes.shapes_partial_reward], train_dataset=train)

    sets = {name: ([p for p in ds["prompt"] for _ in range(8)], [c for c in ds["category"] for _ in range(8)])
            for name, ds in (("trained_prompts", train), ("held_out_prompts", test))}
    before = {name: trainer.generate(p, seed=1234)[0] for name, (p, _) in sets.items()}
    trainer.train()
    after = {name: trainer.generate(p, seed=1234)[0] for name, (p, _) in sets.items()}
    trainer.save_model(args.output_dir)

    scores = {name: {"before": shapes.evaluate(before[name], *sets[name]), "after": shapes.evaluate(after[name], *sets[name])}
              for name in sets}
    with open(os.path.join(args.output_dir, "scores.json"), "w") as f:
        json.dump(scores, f, indent=2)
    # one image per distinct trained prompt (each prompt appears 8 times in a row)
    _save_before_after(before["trained_prompts"][::8], after["trained_prompts"][::8], sets["trained_prompts"][1][::8],
                       os.path.join(args.output_dir, "before_after.png"))
    for name in sets:
        print(f"\n{name}, before training:\n" + shapes.reward.format_evaluation(scores[name]["before"]))
        print(f"{name}, after training:\n" + shapes.reward.format_evaluation(scores[name]["after"]))
    print(f"\nwrote {args.output_dir}/pytorch_lora_weights.safetensors, before_after.png, scores.json")


def _save_before_after(before, after, categories, path, per_category=10):
    from diffusers.utils import make_image_grid
    from PIL import Image

    picks = []
    for c in dict.fromkeys(categories):
        picks += [i for i, cc in enumerate(categories) if cc == c][:per_category]

    def pil(t):
        arr = (t.clamp(0, 1).permute(1, 2, 0).numpy() * 255).round().astype("uint8")
        return Image.fromarray(arr).resize((96, 96), Image.NEAREST)

    cols = min(10, len(picks))
    half_rows = (len(picks) + cols - 1) // cols
    blank = [Image.new("RGB", (96, 96), (64, 64, 64))] * (half_rows * cols - len(picks))
    images = [pil(before[i]) for i in picks] + blank + [pil(after[i]) for i in picks] + blank
    make_image_grid(images, rows=2 * half_rows, cols=cols).save(path)  # top: before, bottom: after


if __name__ == "__main__":
    main()
