"""The 2-process (or 1-process) worker of tests/test_fsdp.py, run by torchrun under FSDP2 or DDP on CPU.

    ACCELERATE_USE_CPU=1 <fsdp2 env> python -m torch.distributed.run --nproc_per_node 2 tests/fsdp_worker.py OUT SPECS

SPECS: comma-separated ``<TrainerClass>:<lora|full>`` runs (2 iterations, a checkpoint each, then ``save_model``),
and ``resume:<TrainerClass>:<lora|full>:<checkpoint>`` runs (resume from that checkpoint into OUT/resume-...).
Per run the main process writes ``<name>.safetensors``: the gathered iteration records and the trained weights
(``w/<name>``, full tensors), and ``<name>.json``: the logged grad norms and the run's recorded distributed state.
"""

from __future__ import annotations

import json
import os
import sys

import torch

import multiprocess_worker as mw

#: The comparison runs: the KL reference forward (beta > 0), EMA and active gradient clipping all exercised.
OPTIONS = dict(beta=0.04, ema_decay=0.5, max_grad_norm=0.05)


def make(cls, output_dir, finetune, **overrides):
    return mw.make_trainer(cls, output_dir, finetune=finetune, **{**OPTIONS, **overrides})


def trained_weights(trainer) -> dict[str, torch.Tensor]:
    """The trained parameters as full tensors (every process calls this: gathering DTensors is a collective)."""
    from trl_flow.trainers.distributed import full_tensors

    model = trainer.accelerator.unwrap_model(trainer.model)
    return full_tensors({n: p for n, p in model.named_parameters() if p.requires_grad})


def run(trainer, name, out_root, resume=None):
    from safetensors.torch import save_file

    records = mw.record_iterations(trainer)
    trainer.train(resume_from_checkpoint=resume)
    weights = trained_weights(trainer)
    trainer.save_model(os.path.join(trainer.config.output_dir, "model"))
    if trainer.accelerator.is_main_process:
        save_file({**records, **{f"w/{k}": v for k, v in weights.items()}}, os.path.join(out_root, f"{name}.safetensors"))
        with open(os.path.join(out_root, f"{name}.json"), "w") as f:
            json.dump({"grad_norm": [h["grad_norm"] for h in trainer.state.log_history],
                       "distributed": trainer.state.distributed}, f)


def main(out_root: str, specs: list[str]) -> None:
    import trl_flow

    torch.set_num_threads(1)
    for spec in specs:
        parts = spec.split(":")
        if parts[0] == "resume":
            _, cls_name, finetune, checkpoint = parts
            name = f"resume-{cls_name}-{finetune}"
            tr = make(getattr(trl_flow, cls_name), os.path.join(out_root, name), finetune)
            run(tr, name, out_root, resume=checkpoint)
        else:
            cls_name, finetune = parts
            name = f"{cls_name}-{finetune}"
            run(make(getattr(trl_flow, cls_name), os.path.join(out_root, name), finetune), name, out_root)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main(sys.argv[1], sys.argv[2].split(","))
