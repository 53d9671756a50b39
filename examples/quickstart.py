"""Quickstart: make the committed tiny SD3 "shapes" model follow its prompts better with Flow-GRPO, on a CPU.

    python examples/quickstart.py                 # ~3-5 minutes on 2 cores
    python examples/quickstart.py --method op_grpo

It loads the base pipeline (a real ``StableDiffusion3Pipeline``, trained here on rendered shapes), trains a LoRA
with the shapes detector's partial score as the reward, and writes to ``--output_dir``:

- ``pytorch_lora_weights.safetensors``: the LoRA, loadable with ``pipe.load_lora_weights(output_dir)``;
- ``before_after.png``: the same held-out prompts and noise before (top rows) and after (bottom rows) training;
- ``scores.json``: strict / partial accuracy per category before and after, on held-out test prompts.
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
    ap.add_argument("--steps", type=int, default=40, help="training iterations")
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
        num_generations=8, prompts_per_step=8, per_device_train_batch_size=32, gradient_accumulation_steps=2,
        learning_rate=1e-3, clip_range=1e-3, beta=0.0, lora_r=16, lora_alpha=32, per_device_eval_batch_size=200,
    )
    trainer = trainer_cls(config, pipe, [shapes.shapes_partial_reward], train_dataset=shapes.train_prompts())

    prompts, categories = shapes.benchmark.eval_prompts("test", per_category=20, seed=1234)
    before, _ = trainer.generate(prompts, seed=1234)
    trainer.train()
    after, _ = trainer.generate(prompts, seed=1234)
    trainer.save_model(args.output_dir)

    scores = {"before": shapes.evaluate(before, prompts, categories), "after": shapes.evaluate(after, prompts, categories)}
    with open(os.path.join(args.output_dir, "scores.json"), "w") as f:
        json.dump(scores, f, indent=2)
    _save_before_after(before, after, categories, os.path.join(args.output_dir, "before_after.png"))
    print("\nheld-out test prompts, before training:\n" + shapes.reward.format_evaluation(scores["before"]))
    print("\nafter training:\n" + shapes.reward.format_evaluation(scores["after"]))
    print(f"\nwrote {args.output_dir}/pytorch_lora_weights.safetensors, before_after.png, scores.json")


def _save_before_after(before, after, categories, path, per_category=4):
    from diffusers.utils import make_image_grid
    from PIL import Image

    picks = []
    for c in dict.fromkeys(categories):
        picks += [i for i, cc in enumerate(categories) if cc == c][:per_category]

    def pil(t):
        arr = (t.clamp(0, 1).permute(1, 2, 0).numpy() * 255).round().astype("uint8")
        return Image.fromarray(arr).resize((96, 96), Image.NEAREST)

    images = [pil(before[i]) for i in picks] + [pil(after[i]) for i in picks]
    cols = min(10, len(picks))
    rows = 2 * ((len(picks) + cols - 1) // cols)
    images += [Image.new("RGB", (96, 96))] * (rows * cols - len(images))
    make_image_grid(images, rows=rows, cols=cols).save(path)


if __name__ == "__main__":
    main()
