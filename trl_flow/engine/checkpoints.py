"""Checkpoints: kill-safe saving, discovery, rotation, resume with a config comparison, and deferred interrupts.

Layout of ``output_dir/checkpoint-<step>`` (a folder appears under this name only once it is complete)::

    pytorch_lora_weights.safetensors   LoRA in diffusers format: pipe.load_lora_weights(<checkpoint>) works
    model.safetensors                  full fine-tuning only (accelerate save_state)
    pytorch_model_fsdp.bin             under FSDP instead (accelerate's FSDP save_state; distributed.check_resume)
    optimizer.bin, random_states_<rank>.pkl, scaler.pt   accelerate save_state (read back with weights_only=True)
    scheduler.json, trainer_state.json, trainer_config.json, ema.safetensors + ema.json
    replay_buffer/ ...                 method-specific state (save_extra_state), e.g. OP-GRPO's buffer
    checkpoint_complete.json           written last: run id, step, method, time and the size + sha256 of every file

Saving writes into ``checkpoint-<step>.tmp`` and renames it when every file (and the marker, last) is on disk, so a
kill at any moment leaves either the previous checkpoints untouched plus a ``.tmp`` folder, or the new complete one.
Resume picks the newest complete checkpoint (by step, never by the clock), warns about and skips incomplete ones,
verifies every file against the marker (an error names a missing or corrupted file), and compares the saved config
with the current one (:func:`compare_configs`). Rotation (``save_total_limit``) deletes only complete checkpoints of
the current run (the run id is stored in the marker), lowest step first.

Nothing here unpickles arbitrary objects: weights and EMA are safetensors, scheduler/trainer state and config JSON;
accelerate's optimizer, RNG and grad-scaler files are read with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import time
import uuid
import warnings

from .. import storage
from ..config_fields import RESUME_KINDS
from ..storage import (SaveError, describe_write_error, follow_umask, read_json, sha256,
                       write_json)
from . import distributed

COMPLETE_NAME = "checkpoint_complete.json"
STATE_NAME = "trainer_state.json"
CONFIG_NAME = "trainer_config.json"
SCHEDULER_NAME = "scheduler.json"
EMA_WEIGHTS_NAME = "ema.safetensors"
EMA_STATE_NAME = "ema.json"
TMP_SUFFIX = ".tmp"
TRASH_SUFFIX = ".deleting"
#: A resumed run that starts before the newest checkpoint of its run moves the later ones (the abandoned branch)
#: into ``abandoned-after-step-<n>-<time>``: nothing is deleted, and resume_from_checkpoint=True no longer sees them.
ABANDONED_PREFIX = "abandoned-after-step-"
_FORMAT = "trl_flow.checkpoint"

def resume_kinds(config_cls, strict: bool = True) -> dict[str, str]:
    """``{field name: resume kind}`` of a config class (:data:`RESUME_KINDS`). A field without one is an error
    (``strict``; ``register_trainer`` checks), else treated as ``notice``."""
    out = {}
    for f in dataclasses.fields(config_cls):
        kind = f.metadata.get("resume", None if strict else "notice")
        if kind not in RESUME_KINDS:
            raise TypeError(f"{config_cls.__name__}.{f.name}: metadata['resume'] must be one of {list(RESUME_KINDS)}, "
                            f"got {kind!r} (how a resumed run treats a change of the field)")
        out[f.name] = kind
    return out


class TrainerState:
    """What a checkpoint needs besides weights and optimizer: the iteration counter, the log history and the id
    of the run (a new run gets a fresh id; a resumed run keeps the id of its checkpoint).

    A trainer's ``state`` is this class mixed into ``transformers.TrainerState`` (:func:`transformers_state`, when
    the trainer is built): callbacks get transformers' own class, with ``global_step``, ``max_steps`` and
    ``log_history`` filled in. This base stays import-light (``import trl_flow`` does not import transformers)."""

    def __init__(self):
        self.global_step = 0
        self.log_history: list[dict] = []
        self.run_id = _new_run_id()
        #: accelerate's distributed type and process count of this run (distributed.describe); a resumed run keeps
        #: its own, the checkpoint's is in the saved trainer_state.json
        self.distributed: dict = {}

    def state_dict(self):
        sd = {"global_step": self.global_step, "log_history": self.log_history, "run_id": self.run_id,
              "distributed": self.distributed}
        if getattr(self, "stateful_callbacks", None):  # transformers' ExportableState callbacks (callbacks.py)
            sd["stateful_callbacks"] = self.stateful_callbacks
        return sd

    def load_state_dict(self, sd):
        self.global_step = int(sd["global_step"])
        self.log_history = list(sd["log_history"])
        self.run_id = str(sd.get("run_id", self.run_id))
        if hasattr(self, "stateful_callbacks"):
            self.stateful_callbacks = dict(sd.get("stateful_callbacks") or {})


def _new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def transformers_state(state: TrainerState | None = None) -> TrainerState:
    """``state`` (default: a fresh one) as a :class:`FlowTrainerState`: a ``transformers.TrainerState`` that is also
    a :class:`TrainerState`, holding the same step, log history (the same list), run id and process layout."""
    cls = _flow_state_class()
    if isinstance(state, cls):
        return state
    new = cls()
    if state is not None:
        new.global_step, new.log_history, new.run_id = state.global_step, state.log_history, state.run_id
        new.distributed = state.distributed
    return new


def _flow_state_class():
    cls = globals().get("FlowTrainerState")
    if cls is None:
        from transformers import TrainerState as HFTrainerState

        @dataclasses.dataclass
        class FlowTrainerState(TrainerState, HFTrainerState):
            """transformers' ``TrainerState`` plus trl_flow's run id and process layout; saved and resumed through
            :meth:`TrainerState.state_dict` (``trainer_state.json`` of a checkpoint)."""

            run_id: str = dataclasses.field(default_factory=_new_run_id)
            distributed: dict = dataclasses.field(default_factory=dict)

        FlowTrainerState.__module__, FlowTrainerState.__qualname__ = __name__, "FlowTrainerState"
        cls = globals()["FlowTrainerState"] = FlowTrainerState
    return cls


def __getattr__(name):  # FlowTrainerState is built on first use (it imports transformers); pickle finds it here
    if name == "FlowTrainerState":
        return _flow_state_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclasses.dataclass
class CheckpointInfo:
    """A complete checkpoint folder, as described by its completion marker."""

    path: str
    step: int
    run_id: str
    method: str
    time: float
    files: dict


def flat_config(cfg) -> dict:
    """The config as JSON-able scalars (lists and other values as their ``str``), as saved in trainer_config.json;
    fields left at None ("the default") hold the value they stand for in this config (``resolved_defaults``)."""
    return {k: (v if isinstance(v, (int, float, str, bool)) or v is None else str(v))
            for k, v in cfg.resolved_dict().items()}


# --------------------------------------------------------------------------------------------------- discovery
def _step_of(name: str) -> int | None:
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    m = re.fullmatch(rf"{PREFIX_CHECKPOINT_DIR}-(\d+)", name)
    return int(m.group(1)) if m else None


def read_marker(path: str) -> CheckpointInfo | None:
    """The completion marker of a checkpoint folder, or None if it has none (or an unreadable one)."""
    try:
        with open(os.path.join(path, COMPLETE_NAME), encoding="utf-8") as f:
            m = json.load(f)
        if m.get("format") != _FORMAT:
            return None
        return CheckpointInfo(path=path, step=int(m["step"]), run_id=str(m["run_id"]), method=str(m["method"]),
                              time=float(m["time"]), files=dict(m["files"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def find_checkpoints(output_dir: str) -> tuple[list[CheckpointInfo], list[str]]:
    """Complete checkpoints of ``output_dir`` oldest first, by step (then save time), and the incomplete ones
    (``checkpoint-<n>`` folders without a valid marker, and ``.tmp`` folders of interrupted saves). Never by the
    clock first: a machine whose clock is behind (or was set back) would otherwise rotate away each new checkpoint
    and resume an older one."""
    complete, incomplete = [], []
    if not os.path.isdir(output_dir):
        return complete, incomplete
    for name in sorted(os.listdir(output_dir)):
        path = os.path.join(output_dir, name)
        if not os.path.isdir(path):
            continue
        if name.endswith(TMP_SUFFIX) and _step_of(name[: -len(TMP_SUFFIX)]) is not None:
            incomplete.append(path)
        elif _step_of(name) is not None:
            info = read_marker(path)
            (complete.append(info) if info is not None else incomplete.append(path))
    complete.sort(key=_step_order)
    return complete, incomplete


def _step_order(c: CheckpointInfo) -> tuple:
    """Checkpoint order: the step counter; the marker's time only between two of one step."""
    return (c.step, c.time)


def normalize_resume(resume):
    """``resume_from_checkpoint`` as ``None`` (do not resume), ``True`` (the newest complete checkpoint) or a path.
    The strings a command line or a YAML recipe gives (``True`` / ``true`` / ``latest``; ``False`` / ``none`` / ``""``)
    mean what the Python values do."""
    if resume is None or resume is False:
        return None
    if resume is True:
        return True
    text = str(resume).strip()
    if text.lower() in ("true", "latest", "yes", "1"):
        return True
    if text.lower() in ("false", "none", "no", "0", ""):
        return None
    return text


def resolve_resume(resume, output_dir: str, print_fn=print) -> CheckpointInfo:
    """The checkpoint to resume from: ``True`` / ``"latest"`` = the newest complete one in ``output_dir`` whose files
    all match its marker (incomplete and corrupted ones are skipped with a warning), or an explicit folder, which
    must be complete (never a ``.tmp`` folder of an interrupted save); its files are verified by
    :func:`verify_files`."""
    resume = normalize_resume(resume)
    if resume is True:
        complete, incomplete = find_checkpoints(output_dir)
        for path in incomplete:
            warnings.warn(f"resume_from_checkpoint: skipping incomplete checkpoint {path} (no {COMPLETE_NAME}: its "
                          "save was interrupted)", RuntimeWarning, stacklevel=3)
        errors = []
        for info in reversed(complete):
            try:
                verify_files(info)
            except ValueError as e:
                warnings.warn(f"resume_from_checkpoint: skipping {info.path}: {e}", RuntimeWarning, stacklevel=3)
                errors.append(str(e).split("; resume from")[0])
                continue
            _warn_other_runs(info, complete)
            return info
        if not complete:
            raise ValueError(f"resume_from_checkpoint: no complete checkpoint-* folder in {output_dir}"
                             + (f" (incomplete: {[os.path.basename(p) for p in incomplete]})" if incomplete else ""))
        raise ValueError(f"resume_from_checkpoint: no checkpoint in {output_dir} is intact ({'; '.join(errors)}); "
                         "start a new run (overwrite_output_dir=True) or restore the files")
    path = in_output_dir(str(resume), output_dir)
    if not os.path.isdir(path):
        raise ValueError(f"resume_from_checkpoint={path!r}: not a folder; give a checkpoint-<N> folder, or "
                         "resume_from_checkpoint=True for the newest complete checkpoint in output_dir")
    name = os.path.basename(os.path.normpath(path))
    if name.endswith(TMP_SUFFIX) or name.endswith(TRASH_SUFFIX):
        complete, _ = find_checkpoints(os.path.dirname(os.path.abspath(path)))
        hint = f"; the newest complete one next to it is {complete[-1].path}" if complete else ""
        raise ValueError(f"resume_from_checkpoint={path!r}: an interrupted save or deletion, not a complete "
                         f"checkpoint (it is deleted at the next start){hint}")
    info = read_marker(path)
    if info is None:
        complete, _ = find_checkpoints(os.path.dirname(os.path.abspath(path)))
        hint = f"; the newest complete one next to it is {complete[-1].path}" if complete else ""
        raise ValueError(f"resume_from_checkpoint: {path} is not a complete trl_flow checkpoint (no valid "
                         f"{COMPLETE_NAME}: its save was interrupted, or trl_flow did not write it){hint}")
    return info


def _warn_other_runs(info: CheckpointInfo, complete: list[CheckpointInfo]) -> None:
    """The newest checkpoint is the highest step, whatever run wrote it: say so when other runs' are there too."""
    others = sorted({c.run_id for c in complete} - {info.run_id})
    if others:
        warnings.warn(f"resume_from_checkpoint: {os.path.dirname(info.path)} holds checkpoints of {len(others) + 1} "
                      f"runs; resuming the highest step, {os.path.basename(info.path)} of run {info.run_id} (pass a "
                      "folder to pick another)", RuntimeWarning, stacklevel=4)


def in_output_dir(path: str, output_dir: str) -> str:
    """A relative ``resume_from_checkpoint`` that is no folder here but one inside ``output_dir`` (a bare
    ``checkpoint-1``) means that one."""
    inside = os.path.join(output_dir, path)
    if not os.path.isdir(path) and not os.path.isabs(path) and os.path.isdir(inside):
        return inside
    return path


def nothing_to_resume(resume, output_dir: str) -> bool:
    """``resume_from_checkpoint=True`` where ``output_dir`` holds no complete checkpoint: the first run of a job
    script that always passes it; it starts a new run."""
    return normalize_resume(resume) is True and not find_checkpoints(output_dir)[0]


def verify_files(info: CheckpointInfo) -> None:
    """Every file listed in the marker exists with its recorded size and sha256; raises naming the file."""
    for rel, meta in info.files.items():
        path = os.path.join(info.path, rel)
        if not os.path.isfile(path):
            raise ValueError(f"checkpoint {info.path}: file {rel} is missing; resume from another checkpoint")
        if os.path.getsize(path) != meta["size"] or sha256(path) != meta["sha256"]:
            raise ValueError(f"checkpoint {info.path}: file {rel} is corrupted (its size or sha256 differs from "
                             f"{COMPLETE_NAME}); resume from another checkpoint")


def clean_leftovers(output_dir: str) -> None:
    """Delete the ``.tmp`` folders of interrupted saves (checkpoints and ``save_model``) and half-deleted rotated
    checkpoints (main process)."""
    if not os.path.isdir(output_dir):
        return
    shutil.rmtree(os.path.join(output_dir, storage.SAVE_TMP_NAME), ignore_errors=True)
    for name in os.listdir(output_dir):
        stem = name[: -len(TMP_SUFFIX)] if name.endswith(TMP_SUFFIX) else (
            name[: -len(TRASH_SUFFIX)] if name.endswith(TRASH_SUFFIX) else None)
        if stem is not None and _step_of(stem) is not None:
            shutil.rmtree(os.path.join(output_dir, name), ignore_errors=True)


def rotate(output_dir: str, run_id: str, limit: int | None) -> list[str]:
    """Keep the ``limit`` newest complete checkpoints of run ``run_id``; delete its older ones (rename first, so
    an interrupted deletion never leaves a checkpoint-<n> folder that looks complete). Returns the deleted paths."""
    if not limit:
        return []
    mine = [c for c in find_checkpoints(output_dir)[0] if c.run_id == run_id]
    deleted = []
    for c in mine[: max(0, len(mine) - limit)]:
        trash = c.path + TRASH_SUFFIX
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(c.path, trash)
        shutil.rmtree(trash, ignore_errors=True)
        deleted.append(c.path)
    return deleted


def kept_note(output_dir: str) -> str:
    """What a stopped run leaves to resume from: the newest complete checkpoint, or that there is none."""
    complete, _ = find_checkpoints(output_dir)
    if complete:
        return f"the newest complete checkpoint is {complete[-1].path} (continue with resume_from_checkpoint=True)"
    return f"no checkpoint was saved in {output_dir}, so there is nothing to resume from"


def set_aside_later(output_dir: str, run_id: str, step: int) -> tuple[str | None, list[str]]:
    """A run resumed at ``step`` owns the steps after it: move the complete checkpoints of run ``run_id`` with a
    larger step (the abandoned branch) into ``output_dir/abandoned-after-step-<step>-<time>/`` (renames: nothing is
    deleted or copied). Returns (that folder, the names moved), or (None, [])."""
    later = [c for c in find_checkpoints(output_dir)[0] if c.run_id == run_id and c.step > step]
    if not later:
        return None, []
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest = os.path.join(output_dir, f"{ABANDONED_PREFIX}{step}-{stamp}")
    n = 1
    while os.path.exists(dest):
        n += 1
        dest = os.path.join(output_dir, f"{ABANDONED_PREFIX}{step}-{stamp}-{n}")
    os.makedirs(dest)
    names = []
    for c in sorted(later, key=lambda c: c.step):
        name = os.path.basename(c.path)
        os.replace(c.path, os.path.join(dest, name))
        names.append(name)
    return dest, names


# ------------------------------------------------------------------------------------------------ save / load
def write_lora(trainer, output_dir: str, sd: dict | None = None) -> None:
    """The current (not EMA) LoRA weights as ``pytorch_lora_weights.safetensors`` via the pipeline's
    ``save_lora_weights``, with the adapter metadata (so ``lora_alpha != r`` round-trips). ``sd``: the full
    adapter weights (:func:`~trl_flow.engine.distributed.lora_state_dict`, gathered by every process when sharded)."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    sd = distributed.lora_state_dict(trainer) if sd is None else sd
    trainer.adapter.save_lora_weights(output_dir, sd, model.peft_config["default"].to_dict())


def read_lora(trainer, input_dir: str) -> None:
    """Load the LoRA file(s) of a checkpoint (``adapter.lora_weight_names()``) into the trained adapter (exact)."""
    from peft.utils import set_peft_model_state_dict

    try:
        sd = trainer.adapter.read_lora_weights(input_dir)
    except Exception as e:
        names = " + ".join(trainer.adapter.lora_weight_names())
        raise ValueError(f"checkpoint {input_dir}: {names} cannot be loaded: {e}") from e
    model = trainer.accelerator.unwrap_model(trainer.model)
    result = set_peft_model_state_dict(model, sd, adapter_name="default")
    if getattr(result, "unexpected_keys", None):
        raise ValueError(f"checkpoint {input_dir}: unexpected adapter keys {result.unexpected_keys[:4]} "
                         "(saved with other lora_target_modules?)")


def lora_state_hooks(trainer):
    """accelerate's save-state / load-state pre-hooks of a LoRA run (for :func:`distributed.prepare`): a checkpoint
    holds the adapter in diffusers format, not the frozen base weights."""

    def save(models, weights, output_dir):
        sd = distributed.lora_state_dict(trainer)  # every process: gathering sharded weights is a collective
        if trainer.accelerator.is_main_process:
            write_lora(trainer, output_dir, sd)
        weights.clear()  # DDP / 1 process: only the adapter is saved, not the frozen base weights

    def load(models, input_dir):
        if distributed.is_fsdp(trainer.accelerator):
            return  # accelerate loads the sharded model itself (FSDP: `models` is empty)
        models.pop()
        read_lora(trainer, input_dir)

    return save, load


def _ema_save(ema, params_named: list[str], path: str, shadow: list) -> None:
    """``shadow``: the EMA weights as full tensors (gathered by every process when sharded)."""
    from safetensors.torch import save_file

    sd = ema.state_dict()
    sd.pop("shadow_params")
    save_file({n: p for n, p in zip(params_named, shadow)},
              os.path.join(path, EMA_WEIGHTS_NAME))
    follow_umask(os.path.join(path, EMA_WEIGHTS_NAME))
    write_json(os.path.join(path, EMA_STATE_NAME), sd)


def _ema_load(ema, params_named: list[str], path: str, decay: float) -> None:
    from safetensors.torch import load_file

    sd = read_json(os.path.join(path, EMA_STATE_NAME))
    tensors = load_file(os.path.join(path, EMA_WEIGHTS_NAME))
    missing = [n for n in params_named if n not in tensors]
    if missing:
        raise ValueError(f"checkpoint {path}: {EMA_WEIGHTS_NAME} lacks {missing[:3]}")
    # sharded like the weights
    sd["shadow_params"] = [distributed.like(tensors[n], p) for n, p in zip(params_named, ema.shadow_params)]
    ema.load_state_dict(sd)
    ema.decay = decay  # the current config's decay (a change is reported by compare_configs)


def trainable_names(trainer) -> list[str]:
    return [n for n, p in trainer.accelerator.unwrap_model(trainer.model).named_parameters() if p.requires_grad]


def save_checkpoint(trainer) -> str:
    """Write ``output_dir/checkpoint-<global_step>`` kill-safely (see the module docstring). Called by every
    process; returns the path. A complete checkpoint of this run at this step is never rewritten. A failed write
    (disk full, ...) removes the partial ``.tmp`` folder and raises :class:`SaveError` on every process, naming the
    disk, the checkpoint, and the previous checkpoint, which is intact."""
    cfg, acc, state = trainer.config, trainer.accelerator, trainer.state
    final = os.path.join(cfg.output_dir, f"checkpoint-{state.global_step}")
    tmp = final + TMP_SUFFIX
    existing = read_marker(final)
    if existing is not None and existing.run_id == state.run_id and existing.step == state.global_step:
        try:  # a corrupted one (skipped on resume) is rewritten
            verify_files(existing)
            return final
        except ValueError:
            pass
    error = None
    if acc.is_main_process:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        except OSError as e:
            error = describe_write_error(tmp, e)
    error = distributed.agree(acc, error)
    if error is None:
        try:  # model (LoRA via the pre-hook), optimizer, RNG states, grad scaler; FSDP: sharded by accelerate
            acc.save_state(tmp)
        except (OSError, RuntimeError) as e:
            error = describe_write_error(tmp, e)
        ema_full = None if trainer.ema is None else distributed.full_tensors(trainer.ema.shadow_params)  # collective
        acc.wait_for_everyone()
        if acc.is_main_process and error is None:
            try:
                _write_own_files(trainer, tmp, ema_full)
            except (OSError, RuntimeError) as e:
                error = describe_write_error(tmp, e)
        error = distributed.agree(acc, error)
    if error is not None:
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)  # frees the space the partial save took
        acc.wait_for_everyone()
        complete = [c for c in find_checkpoints(cfg.output_dir)[0]
                    if os.path.basename(c.path) != os.path.basename(final)]
        previous = (f"the previous checkpoint, {complete[-1].path}, is intact (resume_from_checkpoint=True continues "
                    "from it once the disk has room)" if complete else "no earlier checkpoint exists")
        raise SaveError(f"checkpoint-{state.global_step}: writing it into {cfg.output_dir} failed: {error}; its "
                        f"partial folder was removed, and {previous}")
    if acc.is_main_process:
        if os.path.exists(final):  # another run's (overwrite_output_dir) or an incomplete folder of that name
            shutil.rmtree(final + TRASH_SUFFIX, ignore_errors=True)
            os.replace(final, final + TRASH_SUFFIX)
        os.replace(tmp, final)
        shutil.rmtree(final + TRASH_SUFFIX, ignore_errors=True)
        rotate(cfg.output_dir, state.run_id, cfg.save_total_limit)
    acc.wait_for_everyone()
    return final


def _write_own_files(trainer, tmp: str, ema_full) -> None:
    """The main process's part of a checkpoint: scheduler, state, config, EMA, the method's extra state, then the
    completion marker with every file's size and sha256 (all fsynced)."""
    cfg, acc, state = trainer.config, trainer.accelerator, trainer.state
    write_json(os.path.join(tmp, SCHEDULER_NAME), trainer.lr_scheduler.state_dict())
    write_json(os.path.join(tmp, STATE_NAME), state.state_dict())
    write_json(os.path.join(tmp, CONFIG_NAME), flat_config(cfg))
    if trainer.ema is not None:
        _ema_save(trainer.ema, trainable_names(trainer), tmp, ema_full)
    trainer.save_extra_state(tmp)
    files = {}
    for root, _, names in os.walk(tmp):
        for name in sorted(names):
            p = os.path.join(root, name)
            with open(p, "rb+") as f:
                os.fsync(f.fileno())
            files[os.path.relpath(p, tmp)] = {"size": os.path.getsize(p), "sha256": sha256(p)}
    marker = {"format": _FORMAT, "version": 1, "run_id": state.run_id, "step": state.global_step,
              "method": trainer._method_name, "trainer_class": type(trainer).__name__, "time": time.time(),
              "num_processes": acc.num_processes, "distributed_type": acc.distributed_type.value, "files": files}
    with open(os.path.join(tmp, COMPLETE_NAME), "w", encoding="utf-8") as f:
        json.dump(marker, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def load_checkpoint(trainer, resume) -> CheckpointInfo:
    """Resume ``trainer`` from ``resume`` (a folder, or True / "latest"): verify the files, compare configs,
    then restore weights, optimizer, schedule, EMA, trainer state and the method's extra state."""
    cfg, acc = trainer.config, trainer.accelerator
    info = resolve_resume(resume, cfg.output_dir)
    verify_files(info)
    if info.method != trainer._method_name:
        raise ValueError(f"resume_from_checkpoint: {info.path} was written by method {info.method!r}, this trainer "
                         f"is {trainer._method_name!r}; resume it with the same trainer class")
    saved_cfg = read_json(os.path.join(info.path, CONFIG_NAME))
    trainer.check_saved_config(saved_cfg, os.path.join(info.path, CONFIG_NAME))
    kinds = resume_kinds(type(cfg), strict=False)
    notices = compare_configs(saved_cfg, flat_config(cfg), kinds)
    distributed.check_resume(trainer, info.path,
                             read_json(os.path.join(info.path, COMPLETE_NAME)).get("num_processes"))
    try:
        acc.load_state(info.path)
    except Exception as e:
        raise ValueError(f"checkpoint {info.path}: accelerate could not load it: {type(e).__name__}: {e}") from e
    trainer.lr_scheduler.load_state_dict(read_json(os.path.join(info.path, SCHEDULER_NAME)))
    trainer.state.load_state_dict(read_json(os.path.join(info.path, STATE_NAME)))
    if trainer.ema is not None:
        if os.path.exists(os.path.join(info.path, EMA_WEIGHTS_NAME)):
            _ema_load(trainer.ema, trainable_names(trainer), info.path, cfg.ema_decay)
        else:
            notices.append("ema_decay > 0 but the checkpoint has no EMA: the EMA starts from the current weights")
            trainer.ema.shadow_params = [p.detach().clone() for p in trainer.trainable_params]
    trainer.load_extra_state(info.path)
    trainer._saved_model = None  # other weights now: save_model writes again
    optimizer_fields = [k for k, kind in kinds.items() if kind == "optimizer"]
    if any(saved_cfg.get(k) != flat_config(cfg).get(k) for k in optimizer_fields + ["max_steps"]):
        apply_optimizer_settings(trainer.optimizer, trainer.lr_scheduler, cfg)
        if saved_cfg.get("max_steps") != cfg.max_steps and cfg.lr_scheduler_type not in ("constant",
                                                                                          "constant_with_warmup"):
            notices.append(f"max_steps: {saved_cfg.get('max_steps')} -> {cfg.max_steps} (the {cfg.lr_scheduler_type} "
                           f"learning-rate schedule now spans {cfg.max_steps} iterations)")
    lines = [f"Resuming from {info.path} (step {info.step}, run {info.run_id})"]
    if notices:
        lines.append("Changed settings, applied from this step on: " + "; ".join(notices))
    acc.print("\n".join(lines))
    return info


def compare_configs(saved: dict, current: dict, kinds: dict[str, str]) -> list[str]:
    """Raise ``ValueError`` naming every field of kind ``refuse`` (``kinds``: each field's ``metadata["resume"]``,
    :func:`resume_kinds`) whose value differs between the saved and the current config
    (both values). Returns a notice per other change that is not ``harmless`` (``optimizer`` fields are applied by
    :func:`apply_optimizer_settings`)."""
    refused, notices = [], []
    for name in sorted(set(saved) | set(current)):
        if name not in saved or name not in current or _same(saved[name], current[name]):
            continue
        change = f"{name}: {saved[name]!r} -> {current[name]!r}"
        if kinds.get(name) == "refuse":
            refused.append(change)
        elif kinds.get(name) != "harmless":
            notices.append(change)
    if refused:
        raise ValueError("resume_from_checkpoint: the checkpoint was trained with other settings that cannot change "
                         "mid-run (" + "; ".join(refused) + "); restore them, or start a new run in another "
                         "output_dir")
    return notices


def _same(a, b) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))
    return a == b


def apply_optimizer_settings(optimizer, scheduler, cfg) -> None:
    """Set the config's learning rate, betas, eps and weight decay on the restored optimizer, and the restored
    schedule's position under the config's (possibly changed) schedule: lr = learning_rate * schedule(step)."""
    for group in optimizer.param_groups:
        group["initial_lr"] = cfg.learning_rate
        if "betas" in group:
            group["betas"] = (cfg.adam_beta1, cfg.adam_beta2)
        if "eps" in group:
            group["eps"] = cfg.adam_epsilon
        group["weight_decay"] = cfg.weight_decay
    scheduler.base_lrs = [cfg.learning_rate] * len(optimizer.param_groups)
    lambdas = getattr(scheduler, "lr_lambdas", None)
    if lambdas is None:
        raise ValueError(f"lr_scheduler_type={cfg.lr_scheduler_type!r}: a changed learning rate or schedule cannot be "
                         "applied on resume to this scheduler; keep the checkpoint's settings")
    for group, base, fn in zip(optimizer.param_groups, scheduler.base_lrs, lambdas):
        group["lr"] = base * fn(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
