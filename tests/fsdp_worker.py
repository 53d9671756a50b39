"""The 2-process (or 1-process) worker of tests/test_fsdp.py, run by torchrun under FSDP2 or DDP on CPU.

    ACCELERATE_USE_CPU=1 <fsdp2 env> python -m torch.distributed.run --nproc_per_node 2 tests/fsdp_worker.py OUT SPECS

SPECS: comma-separated ``<TrainerClass>:<lora|full>[:bf16]`` runs (2 iterations, a checkpoint each, then
``save_model``), ``resume:<TrainerClass>:<lora|full>:<checkpoint>`` runs (resume from that checkpoint into
OUT/resume-...), and ``refuse:<TrainerClass>`` (building it must raise: the message goes to
``refuse-<TrainerClass>.json``).
Per run the main process writes ``<name>.safetensors``: the gathered iteration records and the trained weights
(``w/<name>``, full tensors), ``<name>.json``: the logged grad norms and the run's recorded distributed state; every
process writes ``<name>.rank<r>.json``: how many parameter elements it holds of the model and of the frozen reference
copy.
"""

from __future__ import annotations

import json
import os
import sys

import torch

import multiprocess_worker as mw

#: The comparison runs: the KL reference forward (beta > 0), EMA and active gradient clipping all exercised.
OPTIONS = dict(beta=0.04, ema_decay=0.5, max_grad_norm=1e-4)  # gradient norms: LoRA ~4e-4, full ~3e-2


def make(cls, output_dir, finetune, **overrides):
    return mw.make_trainer(cls, output_dir, finetune=finetune, **{**OPTIONS, **overrides})


def trained_weights(trainer) -> dict[str, torch.Tensor]:
    """The trained parameters as full tensors (every process calls this: gathering DTensors is a collective)."""
    from trl_flow.engine.distributed import full_tensors

    model = trainer.accelerator.unwrap_model(trainer.model)
    return {n: t.clone()
            for n, t in full_tensors({n: p for n, p in model.named_parameters() if p.requires_grad}).items()}


def numels(module) -> list[int] | None:
    """[elements this process holds, elements of the full parameters] of a module (None: no module)."""
    from torch.distributed.tensor import DTensor

    if module is None:
        return None
    params = list(module.parameters())
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params)
    return [local, sum(p.numel() for p in params)]


def record(trainer) -> dict[str, torch.Tensor]:
    """mw.record_iterations, plus the trained weights after each iteration (``<iteration>/w/<name>``)."""
    records = mw.record_iterations(trainer)
    iteration = trainer.training_iteration

    def recording(step):
        metrics = iteration(step)
        it = len({k.split("/")[0] for k in records if "/w/" in k})
        records.update({f"{it}/w/{k}": v for k, v in trained_weights(trainer).items()})
        return metrics

    trainer.training_iteration = recording
    return records


def run(trainer, name, out_root, resume=None):
    from safetensors.torch import save_file

    records = record(trainer)
    trainer.train(resume_from_checkpoint=resume)
    weights = trained_weights(trainer)
    with open(os.path.join(out_root, f"{name}.rank{trainer.accelerator.process_index}.json"), "w") as f:
        json.dump({"model": numels(trainer.model), "ref_model": numels(trainer.ref_model)}, f)
    trainer.save_model(os.path.join(trainer.config.output_dir, "model"))
    if trainer.accelerator.is_main_process:
        save_file({**records, **{f"w/{k}": v for k, v in weights.items()}},
                  os.path.join(out_root, f"{name}.safetensors"))
        with open(os.path.join(out_root, f"{name}.json"), "w") as f:
            json.dump({"grad_norm": [h["grad_norm"] for h in trainer.state.log_history],
                       "distributed": trainer.state.distributed}, f)


def main(out_root: str, specs: list[str]) -> None:
    import trl_flow

    torch.set_num_threads(1)
    for spec in specs:
        parts = spec.split(":")
        if parts[0] == "refuse":  # the trainer must refuse to be built; record the message
            try:
                make(getattr(trl_flow, parts[1]), os.path.join(out_root, spec), "lora")
                message = None
            except Exception as e:  # noqa: BLE001 - the test checks what was raised
                message = f"{type(e).__name__}: {e}"
            with open(os.path.join(out_root, f"refuse-{parts[1]}.json"), "w") as f:
                json.dump({"error": message}, f)
        elif parts[0] == "resume":
            _, cls_name, finetune, checkpoint = parts
            name = f"resume-{cls_name}-{finetune}"
            # One process: microbatches accumulated in pairs, so each optimizer step sees the samples of a
            # 2-process one
            accumulation = 2 if int(os.environ.get("WORLD_SIZE", "1")) == 1 else 1
            tr = make(getattr(trl_flow, cls_name), os.path.join(out_root, name), finetune,
                      gradient_accumulation_steps=accumulation)
            run(tr, name, out_root, resume=checkpoint)
        else:  # <TrainerClass>:<lora|full>[:bf16]
            cls_name, finetune, *precision = parts
            name = "-".join([cls_name, finetune, *precision])
            run(make(getattr(trl_flow, cls_name), os.path.join(out_root, name), finetune, bf16=precision == ["bf16"]),
                name, out_root)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main(sys.argv[1], sys.argv[2].split(","))
    from trl_flow.engine.distributed import end_processes

    end_processes()  # as the CLI does: a process group left to interpreter exit can abort a finished rank (gloo)
