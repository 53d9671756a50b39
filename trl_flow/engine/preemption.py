"""Preemption checkpoints: on SIGTERM the last completed iteration is on disk within seconds, whatever the grace.

A scheduler (Slurm's time limit or ``scancel``, ``systemctl stop``, Kubernetes) sends SIGTERM and SIGKILLs the job a
grace period later: 30 s by default for Slurm (``KillWait``), Kubernetes and torch's launcher behind torchrun and
``accelerate launch``. An iteration plus its checkpoint can take longer. So at every iteration boundary the main
process keeps a CPU copy of what a checkpoint of that iteration needs (LoRA weights, optimizer, learning-rate
schedule, trainer state, EMA, grad scaler: small for a LoRA), and on the first SIGTERM a thread started by the
interrupt guard's watcher writes it as ``checkpoint-<step>`` at once, while the main thread goes on with the current
iteration (it is saved too, and the run exits with status 143, if there is time). The watcher runs whatever the main
thread does, so this works while it waits in a collective or a long kernel, and needs no other process.

The copy is written like any checkpoint (``.tmp`` folder, fsync, marker last, rename; the marker says
``"preemption": true``) and resumes like one: every random draw of a run is derived from ``(seed, iteration)``, so the
processes' RNG files are not needed. When the stop at the end of the iteration saves the newer checkpoint, the
preemption checkpoint (not a ``save_steps`` one) is deleted again.

Not kept (the iteration's end is saved as before): ``finetune="full"`` (the copy would be the whole model), FSDP
(sharded state), and trainers with method state of their own (OP-GRPO's replay buffer, DiffusionNFT's old policy).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
import signal
import threading
import time

import torch

from .. import storage
from . import checkpoints


@dataclasses.dataclass
class Snapshot:
    """CPU copies of a checkpoint's contents at the end of iteration ``step``."""

    step: int
    lora: dict
    optimizer: dict
    scheduler: dict
    state: dict
    ema_meta: dict | None
    ema_shadow: list | None
    scaler: dict | None


def _cpu_copy(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu_copy(v) for v in obj)
    return copy.deepcopy(obj)


def unsupported_reason(trainer) -> str | None:
    """Why this trainer's iterations cannot be kept for a preemption checkpoint, or None."""
    from .distributed import is_fsdp

    if trainer.config.finetune != "lora":
        return f"finetune={trainer.config.finetune!r} (the copy would be the whole model)"
    if is_fsdp(trainer.accelerator):
        return "FSDP (sharded state)"
    own = [type(trainer).save_extra_state, type(trainer).save_checkpoint]
    if any(not f.__qualname__.startswith("FlowRLTrainer.") for f in own):  # overridden by the method
        return f"{type(trainer).__name__} keeps method state of its own"
    return None


def take_snapshot(trainer) -> Snapshot:
    """What ``checkpoint-<global_step>`` would hold, copied to CPU (main process, at an iteration boundary)."""
    from .distributed import lora_state_dict

    acc = trainer.accelerator
    ema_meta = ema_shadow = None
    if trainer.ema is not None:
        ema_meta = trainer.ema.state_dict()
        ema_meta.pop("shadow_params", None)
        ema_meta = _cpu_copy(ema_meta)
        ema_shadow = [_cpu_copy(p) for p in trainer.ema.shadow_params]
    scaler = getattr(acc, "scaler", None)
    return Snapshot(step=trainer.state.global_step, lora=lora_state_dict(trainer),
                    optimizer=_cpu_copy(trainer.optimizer.state_dict()),
                    scheduler=copy.deepcopy(trainer.lr_scheduler.state_dict()),
                    state=json.loads(json.dumps(trainer.state.state_dict())), ema_meta=ema_meta,
                    ema_shadow=ema_shadow, scaler=None if scaler is None else _cpu_copy(scaler.state_dict()))


def write_snapshot(trainer, snap: Snapshot) -> str:
    """Write ``snap`` as ``output_dir/checkpoint-<step>`` kill-safely (another thread may run the next iteration
    meanwhile: only the snapshot and the run's fixed settings are read). Returns the path."""
    from safetensors.torch import save_file

    cfg = trainer.config
    final = os.path.join(cfg.output_dir, f"checkpoint-{snap.step}")
    tmp = final + checkpoints.TMP_SUFFIX
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    checkpoints.write_lora(trainer, tmp, snap.lora)
    torch.save(snap.optimizer, os.path.join(tmp, "optimizer.bin"))
    if snap.scaler is not None:
        torch.save(snap.scaler, os.path.join(tmp, "scaler.pt"))
    storage.write_json(os.path.join(tmp, checkpoints.SCHEDULER_NAME), snap.scheduler)
    storage.write_json(os.path.join(tmp, checkpoints.STATE_NAME), snap.state)
    storage.write_json(os.path.join(tmp, checkpoints.CONFIG_NAME), checkpoints.flat_config(cfg))
    if snap.ema_shadow is not None:
        names = checkpoints.trainable_names(trainer)
        save_file(dict(zip(names, snap.ema_shadow)), os.path.join(tmp, checkpoints.EMA_WEIGHTS_NAME))
        storage.follow_umask(os.path.join(tmp, checkpoints.EMA_WEIGHTS_NAME))
        storage.write_json(os.path.join(tmp, checkpoints.EMA_STATE_NAME), snap.ema_meta)
    files = {}
    for root, _, names in os.walk(tmp):
        for name in sorted(names):
            p = os.path.join(root, name)
            with open(p, "rb+") as f:
                os.fsync(f.fileno())
            files[os.path.relpath(p, tmp)] = {"size": os.path.getsize(p), "sha256": storage.sha256(p)}
    acc = trainer.accelerator
    marker = {"format": checkpoints._FORMAT, "version": 1, "run_id": snap.state["run_id"], "step": snap.step,
              "method": trainer._method_name, "trainer_class": type(trainer).__name__, "time": time.time(),
              "num_processes": acc.num_processes, "distributed_type": acc.distributed_type.value,
              "preemption": True, "files": files}
    with open(os.path.join(tmp, checkpoints.COMPLETE_NAME), "w", encoding="utf-8") as f:
        json.dump(marker, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    if os.path.exists(final):  # an incomplete folder of that name (a complete one is never rewritten)
        shutil.rmtree(final + checkpoints.TRASH_SUFFIX, ignore_errors=True)
        os.replace(final, final + checkpoints.TRASH_SUFFIX)
    os.replace(tmp, final)
    shutil.rmtree(final + checkpoints.TRASH_SUFFIX, ignore_errors=True)
    return final


class PreemptionCheckpoint:
    """The training loop's side: :meth:`record` at each iteration boundary, :meth:`on_signal` from the interrupt
    guard's watcher, :meth:`wait` and :meth:`drop_superseded` around the stop's own save."""

    #: the signals that get a preemption checkpoint (Ctrl-C is a person at a terminal, who can wait)
    SIGNALS = (signal.SIGTERM,)

    def __init__(self, trainer):
        self.trainer = trainer
        self.reason = unsupported_reason(trainer)
        self.enabled = trainer.accelerator.is_main_process and self.reason is None
        self.snapshot: Snapshot | None = None
        self.saved: str | None = None
        self._thread_done = threading.Event()
        self._thread_done.set()
        self._lock = threading.Lock()

    def record(self) -> None:
        """Keep the state at the end of the iteration just finished (main thread)."""
        if not self.enabled:
            return
        cfg, step = self.trainer.config, self.trainer.state.global_step
        if step >= cfg.max_steps:
            self.snapshot = None  # the final model is being saved
            return
        snap = take_snapshot(self.trainer)
        with self._lock:
            self.snapshot = snap

    def _needed(self, snap: Snapshot | None) -> bool:
        if snap is None:
            return False
        cfg = self.trainer.config
        if cfg.save_steps and snap.step % cfg.save_steps == 0:
            return False  # the loop writes (or has written) that checkpoint itself
        return checkpoints.read_marker(os.path.join(cfg.output_dir, f"checkpoint-{snap.step}")) is None

    def on_signal(self, signum: int) -> None:
        """The first signal (watcher thread): write the last completed iteration now, and say so."""
        if signum not in self.SIGNALS:
            return
        if self.reason is not None and self.trainer.accelerator.is_main_process:
            print(f"{signal.Signals(signum).name}: no copy of the last completed iteration is kept for "
                  f"{self.reason}: only the end of this iteration is saved (a kill before it loses the iteration).",
                  flush=True)
        if not self.enabled:
            return
        received = time.monotonic()
        self._thread_done.clear()
        try:
            with self._lock:
                snap = self.snapshot
            if not self._needed(snap):
                return
            path = write_snapshot(self.trainer, snap)
            self.saved = path
            print(f"{signal.Signals(signum).name}: saved {path} (iteration {snap.step}, the last completed one) "
                  f"{time.monotonic() - received:.1f} s after the signal; finishing iteration {snap.step + 1} "
                  f"if there is time (a kill before its end keeps checkpoint-{snap.step}).", flush=True)
        except Exception as e:  # noqa: BLE001 - the loop's own save at the iteration's end is still to come
            print(f"{signal.Signals(signum).name}: the preemption checkpoint could not be written "
                  f"({type(e).__name__}: {e}); the iteration's end is saved as usual.", flush=True)
        finally:
            self._thread_done.set()

    def wait(self, timeout: float = 600.0) -> None:
        """Until a preemption save in progress is done (before the loop's own save at the stop)."""
        self._thread_done.wait(timeout)

    def drop_superseded(self, newest: str) -> None:
        """The stop saved ``newest``: delete the preemption checkpoint it supersedes (not a ``save_steps`` one)."""
        if not self.saved or os.path.abspath(self.saved) == os.path.abspath(newest):
            return
        info = checkpoints.read_marker(self.saved)
        if info is not None and checkpoints.read_marker(newest) is not None:
            trash = self.saved + checkpoints.TRASH_SUFFIX
            os.replace(self.saved, trash)
            shutil.rmtree(trash, ignore_errors=True)
        self.saved = None
