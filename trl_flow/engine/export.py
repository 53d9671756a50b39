"""Export: the trained weights in diffusers format (a LoRA file, or the whole pipeline), written atomically."""

from __future__ import annotations

import os

from ..storage import SaveError, describe_write_error, write_atomically
from . import distributed


def save_model(trainer, output_dir: str) -> str:
    """See :meth:`FlowRLTrainer.save_model`; under FSDP every process gathers, the main one writes.

    The main process writes atomically (:func:`~trl_flow.storage.write_atomically`): a failure or an
    interrupt leaves ``output_dir`` as it was. A failed write raises
    :class:`~trl_flow.storage.SaveError` on every process, naming the folder and the disk."""
    acc = trainer.accelerator
    acc.wait_for_everyone()
    model = acc.unwrap_model(trainer.model)
    error = cause = None
    with trainer.ema_weights():
        if trainer.config.finetune == "lora":
            sd = distributed.lora_state_dict(trainer)
            meta = model.peft_config["default"].to_dict()
            write = lambda folder: trainer.adapter.save_lora_weights(folder, sd, meta)  # noqa: E731
        elif distributed.is_fsdp(acc):
            sd = acc.get_state_dict(trainer.model)  # full weights on the main process (a collective)
            write = lambda folder: _save_pipeline_with(trainer.pipe, model, sd, folder)  # noqa: E731
        else:
            write = trainer.pipe.save_pretrained
        if acc.is_main_process:
            try:
                write_atomically(output_dir, write)
            except Exception as e:  # OSError, torch's RuntimeError, safetensors' own error type
                error, cause = describe_write_error(output_dir, e), e
    error = distributed.agree(acc, error)
    if error is not None:
        raise SaveError(f"save_model: writing the model into {output_dir} failed: {error}; nothing of this save was "
                        f"kept ({output_dir} holds what it held before)") from cause
    acc.wait_for_everyone()
    return output_dir


def _save_pipeline_with(pipe, sharded, state_dict: dict, output_dir: str) -> None:
    """``pipe.save_pretrained`` with the transformer rebuilt unsharded from ``state_dict`` (full weights)."""
    from torch.distributed.fsdp import FSDPModule

    cls = next(c for c in type(sharded).__mro__ if not issubclass(c, FSDPModule))  # FSDP2 subclasses the model
    plain = cls.from_config(sharded.config)
    plain.load_state_dict(state_dict, strict=True)
    components = {**pipe.components, "transformer": plain}
    os.makedirs(output_dir, exist_ok=True)
    type(pipe)(**components).save_pretrained(output_dir)
