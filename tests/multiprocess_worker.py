"""Shared by tests/test_multiprocess.py and its 2-process worker (this file, run by torchrun).

Every trainer class that ``trl_flow`` exports is trained on the tiny pipeline; per iteration the gathered
trajectories, log-probs, rewards and advantages are recorded, then the LoRA and (OP-GRPO) a hash of the replay
buffer on each process.

    ACCELERATE_USE_CPU=1 python -m torch.distributed.run --nproc_per_node 2 tests/multiprocess_worker.py OUT NAMES \
        [CONFIG_OVERRIDES_JSON]
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys

import torch

PROMPTS = ["a cat", "a red dog", "a blue car", "green sky", "an owl", "a tree"]


def brightness(images, prompts, **kwargs):
    return images.mean(dim=(1, 2, 3))


def trainer_classes() -> list[type]:
    """Every concrete trainer ``trl_flow`` exports: trainers added later join the multi-process tests."""
    import trl_flow

    return [obj for name in trl_flow.__all__ if isinstance(obj := getattr(trl_flow, name), type)
            and issubclass(obj, trl_flow.FlowRLTrainer) and obj is not trl_flow.FlowRLTrainer]


def make_trainer(cls, output_dir: str, **overrides):
    """A 2-iteration run: 2 prompts x 4 generations, microbatches of 4, a checkpoint per iteration.

    One inner epoch (later epochs shuffle within each process, so their microbatches differ by design) and eval
    batches of 4 (Stepwise-Flow-GRPO scores intermediate states in such batches: 4 keeps their composition equal
    on 1 and 2 processes, as a matmul's rounding depends on its batch)."""
    from trl_flow.testing import tiny_sd3_pipeline

    kwargs = dict(output_dir=output_dir, max_steps=2, num_generations=4, prompts_per_step=2,
                  per_device_train_batch_size=4, height=32, width=32, max_sequence_length=16, num_inference_steps=4,
                  guidance_scale=1.0, lora_r=4, lora_alpha=8, learning_rate=1e-3, clip_range=5e-2, beta=0.0,
                  disable_tqdm=True, save_steps=1, off_policy_fraction=0.5, num_inner_epochs=1,
                  per_device_eval_batch_size=4)
    kwargs.update(overrides)
    fields = {f.name for f in dataclasses.fields(cls.config_class)}
    config = cls.config_class(**{k: v for k, v in kwargs.items() if k in fields})
    return cls(config, tiny_sd3_pipeline(), [brightness], train_dataset=list(PROMPTS))


def record_iterations(trainer) -> dict[str, torch.Tensor]:
    """Filled during ``train()``: ``<iteration>/<name>`` -> the gathered tensor, after the advantages."""
    records = {}
    compute = trainer.compute_advantages

    def recording(rollout):
        compute(rollout)
        it = len({k.split("/")[0] for k in records})
        for name in ("states", "log_probs", "rewards", "advantages"):
            records[f"{it}/{name}"] = trainer.gather(getattr(rollout, name).float().contiguous())

    trainer.compute_advantages = recording
    return records


def lora(trainer) -> dict[str, torch.Tensor]:
    model = trainer.accelerator.unwrap_model(trainer.model)
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters() if "lora_" in n}


def buffer_hash(trainer) -> str | None:
    buf = getattr(trainer, "replay_buffer", None)
    if buf is None:
        return None
    h = hashlib.sha256()
    for e in sorted(buf, key=lambda e: e.prompt):
        h.update(json.dumps([e.prompt, e.columns, e.reward, e.step]).encode())
        for t in (e.states, e.log_probs, e.sigmas):
            h.update(t.numpy().tobytes())
    return h.hexdigest()


def main(out_root: str, names: list[str], overrides: dict | None = None) -> None:
    import trl_flow
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    for name in names:
        tr = make_trainer(getattr(trl_flow, name), os.path.join(out_root, name), **(overrides or {}))
        records = record_iterations(tr)
        tr.train()
        rank = tr.accelerator.process_index
        with open(os.path.join(out_root, f"{name}.rank{rank}.json"), "w") as f:
            json.dump({"num_processes": tr.accelerator.num_processes, "buffer_hash": buffer_hash(tr)}, f)
        if tr.accelerator.is_main_process:
            save_file({**records, **{f"lora/{k}": v for k, v in lora(tr).items()}},
                      os.path.join(out_root, f"{name}.safetensors"))
    # Tear the process group down before exit, as the CLI does: left to interpreter shutdown, gloo's threads were
    # sometimes destroyed while joinable and a rank died with SIGABRT after its results were written.
    from trl_flow.engine.distributed import end_processes

    end_processes()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main(sys.argv[1], sys.argv[2].split(","), json.loads(sys.argv[3]) if len(sys.argv) > 3 else None)
