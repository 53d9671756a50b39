"""The final weights are never lost to a full disk: free space is checked at the start, and a failed final write
goes to a fallback folder.

At the start of ``train()`` the free space on ``output_dir``'s disk is compared with what the run will write: the
final weights (LoRA, or the whole pipeline for ``finetune="full"``) and, with ``save_steps``, a checkpoint (the
trained weights and Adam's two moments). Less than the final weights is refused (the end of the run could not be
saved; ``check_free_space=False`` goes on); less than the final weights plus two checkpoints is a warning.

When the final save into ``output_dir`` fails (a full disk, a quota), the weights are written instead into the first
fallback folder that takes them -- ``$TRL_FLOW_RESCUE_DIR``, ``~/.cache/trl_flow/rescue/<run>``, then
``$TMPDIR/trl_flow-rescue/<run>`` -- and the error names it: from the command line the process ends with the error,
and before this every trained weight was lost with it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings

from .. import storage
from . import distributed


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def expected_sizes(trainer) -> tuple[int, int]:
    """Bytes of the final weights and of one checkpoint (estimates from the parameters)."""
    trained = sum(p.numel() * 4 for p in trainer.trainable_params)  # LoRA / full weights are trained in float32
    if trainer.config.finetune == "lora":
        final = trained
    else:
        final = 0
        for module in trainer.pipe.components.values():
            if hasattr(module, "parameters"):
                final += sum(p.numel() * p.element_size() for p in module.parameters())
    return final, 3 * trained


def free_bytes(path: str) -> int | None:
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    try:
        return shutil.disk_usage(probe).free
    except OSError:
        return None


def check_free_space(trainer) -> None:
    """Refuse (every process) when ``output_dir``'s disk cannot hold the final weights, warn when it cannot hold
    them and two checkpoints; ``check_free_space=False`` skips this."""
    cfg, acc = trainer.config, trainer.accelerator
    if not getattr(cfg, "check_free_space", True):
        return
    error = None
    if acc.is_main_process:
        free = free_bytes(cfg.output_dir)
        final, ckpt = expected_sizes(trainer)
        need = final + (2 * ckpt if cfg.save_steps else 0)
        where = storage.disk_note(cfg.output_dir)
        if free is not None and free < final:
            error = (f"output_dir={cfg.output_dir!r}: {where} cannot hold the trained weights (about {_mib(final)}), "
                     "so the end of this run could not be saved; free space or choose another output_dir, or pass "
                     "check_free_space=False to go on anyway (nothing was computed yet)")
        elif free is not None and free < need:
            ckpts = f" and two checkpoints of {_mib(ckpt)}" if cfg.save_steps else ""
            warnings.warn(f"output_dir={cfg.output_dir!r}: {where}; this run writes about {_mib(need)} (the final "
                          f"weights {_mib(final)}{ckpts}): a save may fail for lack of space", RuntimeWarning,
                          stacklevel=3)
    error = distributed.agree(acc, error)
    if error:
        raise ValueError(error)


def rescue_folders(trainer) -> list[str]:
    """Where a failed final save puts the weights, in order of preference."""
    cfg = trainer.config
    run = f"{os.path.basename(os.path.normpath(cfg.output_dir)) or 'run'}-{trainer.state.run_id}"
    folders = []
    if os.environ.get("TRL_FLOW_RESCUE_DIR"):
        folders.append(os.path.join(os.environ["TRL_FLOW_RESCUE_DIR"], run))
    folders.append(os.path.join(os.path.expanduser("~"), ".cache", "trl_flow", "rescue", run))
    folders.append(os.path.join(tempfile.gettempdir(), "trl_flow-rescue", run))
    return folders


def save_to_rescue_folder(trainer) -> tuple[str | None, list[str]]:
    """After the final save into ``output_dir`` failed: write the weights into the first fallback folder that takes
    them (every process calls this, like ``save_model``). Returns (that folder or None, what failed where)."""
    failures = []
    for folder in rescue_folders(trainer):
        try:
            os.makedirs(folder, exist_ok=True)
            trainer.save_model(folder)
            return folder, failures
        except (storage.SaveError, OSError, ValueError) as e:
            failures.append(f"{folder}: {str(e).splitlines()[0][:200]}")
    return None, failures
