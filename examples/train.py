"""Train a LoRA with any trl_flow trainer on a diffusers pipeline; runs under `accelerate launch`.

GPU (the published Flow-GRPO recipe on SD3.5-M, GenEval-style prompts from a .jsonl or the Hub):

    accelerate launch examples/train.py --method flow_grpo \\
        --model_name_or_path stabilityai/stable-diffusion-3.5-medium --torch_dtype bfloat16 --bf16 \\
        --dataset prompts.jsonl --reward jpeg_incompressibility \\
        --output_dir sd35-flow-grpo --max_steps 1000 --num_generations 24 --prompts_per_step 16 \\
        --per_device_train_batch_size 8 --gradient_accumulation_steps 4 --height 512 --width 512 \\
        --ema_decay 0.9 --report_to wandb --save_steps 50 --push_to_hub

CPU smoke run on the shapes task (the committed tiny SD3 base model):

    python examples/train.py --method op_grpo --model_name_or_path shapes --dataset shapes \\
        --reward shapes_partial --output_dir out/shapes-op --max_steps 5 --height 32 --width 32 \\
        --num_inference_steps 10 --guidance_scale 3 --max_sequence_length 1 --num_generations 8

Every field of the chosen method's config is a flag (`--help` lists them with their help text).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field

from trl import TrlParser

import trl_flow
from trl_flow import rewards as builtin_rewards

METHODS = {
    "flow_grpo": (trl_flow.FlowGRPOConfig, trl_flow.FlowGRPOTrainer),
    "op_grpo": (trl_flow.OPGRPOConfig, trl_flow.OPGRPOTrainer),
    "flow_dppo": (trl_flow.FlowDPPOConfig, trl_flow.FlowDPPOTrainer),
}


def reward_by_name(name: str):
    if name in ("jpeg_compressibility", "jpeg_incompressibility"):
        return getattr(builtin_rewards, name)
    if name in ("shapes_partial", "shapes_strict"):
        from trl_flow.tasks import shapes

        return getattr(shapes, f"{name}_reward")
    raise ValueError(f"--reward {name!r}: unknown; use jpeg_compressibility, jpeg_incompressibility, "
                     "shapes_partial or shapes_strict (or call the trainer from Python with your own callable)")


@dataclass
class ScriptArguments:
    model_name_or_path: str = field(default="stabilityai/stable-diffusion-3.5-medium", metadata={"help": "Hub id or folder of a diffusers pipeline (SD3/3.5), or `shapes` for the committed tiny shapes base model."})
    torch_dtype: str = field(default="float32", metadata={"help": "dtype to load the pipeline in: float32, bfloat16, float16."})
    dataset: str = field(default="shapes", metadata={"help": "Prompts: a .txt (one per line), a .jsonl with a `prompt` key, a Hub dataset, or `shapes` (the shapes task's train split)."})
    eval_dataset: str | None = field(default=None, metadata={"help": "Evaluation prompts, same formats (`shapes` = the shapes test split)."})
    reward: list[str] = field(default_factory=lambda: ["jpeg_incompressibility"], metadata={"help": "Reward function names."})


def load_dataset_arg(source: str, split: str):
    if source == "shapes":
        from trl_flow.tasks import shapes

        return shapes.train_prompts() if split == "train" else shapes.test_prompts()
    return trl_flow.data.load_prompts(source)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--method", choices=sorted(METHODS), default="flow_grpo")
    known, rest = pre.parse_known_args(argv)
    config_cls, trainer_cls = METHODS[known.method]
    script_args, config = TrlParser((ScriptArguments, config_cls)).parse_args_into_dataclasses(rest)
    if script_args.model_name_or_path == "shapes":
        from trl_flow.tasks import shapes

        pipe = shapes.load_base_pipeline()
    else:
        pipe = trl_flow.models.load_pipeline(script_args.model_name_or_path, script_args.torch_dtype)
    train = load_dataset_arg(script_args.dataset, "train")
    evald = load_dataset_arg(script_args.eval_dataset, "test") if script_args.eval_dataset else None
    trainer = trainer_cls(config, pipe, [reward_by_name(r) for r in script_args.reward],
                          train_dataset=train, eval_dataset=evald)
    trainer.train()
    trainer.save_model(config.output_dir)
    return trainer


if __name__ == "__main__":
    main()
