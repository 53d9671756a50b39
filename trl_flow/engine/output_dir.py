"""The output folder of a run: writable before any compute, locked while a run uses it, never mixing two runs.

A new (not resumed) run refuses an ``output_dir`` that holds any earlier run's outputs: its checkpoints, and also a
finished run without checkpoints (the final LoRA or pipeline, ``log_history.jsonl``, ``samples/``, tensorboard
folders, ``abandoned-after-step-*`` folders). Resuming continues that run; ``overwrite_output_dir=True`` first
deletes those outputs, each by name, directly inside ``output_dir`` (a symlink is unlinked, never followed), so
nothing of two runs mixes. Nothing else in the folder is touched.

While ``train()`` runs, the main process holds an exclusive lock (``fcntl.flock``) on ``output_dir/.trl_flow.lock``:
a second run in the same folder is refused at its start, naming the first one's process. The kernel releases the
lock when its process ends, however it ends, so a killed run never blocks the next one.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import time
import warnings

from .. import storage
from . import checkpoints, distributed

LOG_NAME = "log_history.jsonl"
SAMPLES_DIR = "samples"
PIPELINE_INDEX = "model_index.json"
LOCK_NAME = ".trl_flow.lock"
#: The files a tensorboard tracker (accelerate's, with project_dir=output_dir) writes under output_dir/<run name>.
_TRACKER_FILE = re.compile(r"events\.out\.tfevents\..*|hparams\.yml")
#: A pipeline component folder name as diffusers' save_pretrained writes it (a python identifier).
_COMPONENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def check_writable(path: str, field: str = "output_dir") -> None:
    """``path`` (a folder, created later if missing) can be written: the folder itself, or its nearest existing
    parent. Raises a ``ValueError`` naming ``field`` and the fix, before any compute."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if os.path.exists(probe) and not os.path.isdir(probe):
        raise ValueError(f"{field}={path!r}: {probe} is a file, not a folder; choose another {field}")
    if not os.access(probe, os.W_OK | os.X_OK):
        where = "it" if probe == os.path.abspath(path) else f"its parent {probe}"
        raise ValueError(f"{field}={path!r}: {where} is not writable; choose a writable {field} (nothing was "
                         "computed yet)")


def earlier_outputs(output_dir: str, run_id: str) -> list[str]:
    """Names in ``output_dir`` that an earlier run wrote: other runs' (and incomplete) checkpoints, a final LoRA or
    pipeline, a non-empty log, sample grids, tensorboard folders and abandoned branches. ``.tmp`` folders of
    interrupted saves are not listed (they are deleted at every start)."""
    if not os.path.isdir(output_dir):
        return []
    complete, incomplete = checkpoints.find_checkpoints(output_dir)
    found = [os.path.basename(c.path) for c in complete if c.run_id != run_id]
    found += [os.path.basename(p) for p in incomplete if not p.endswith(checkpoints.TMP_SUFFIX)]
    for name in (storage.LORA_WEIGHT_NAME, PIPELINE_INDEX):
        if os.path.isfile(os.path.join(output_dir, name)):
            found.append(name)
    lora_stem = storage.LORA_WEIGHT_NAME.rsplit(".", 1)[0]  # a family's further LoRA files (Wan2.2's second expert)
    found += sorted(n for n in os.listdir(output_dir) if n.startswith(lora_stem + "_") and n.endswith(".safetensors")
                    and os.path.isfile(os.path.join(output_dir, n)))
    log = os.path.join(output_dir, LOG_NAME)
    if os.path.isfile(log) and os.path.getsize(log) > 0:
        found.append(LOG_NAME)
    samples = os.path.join(output_dir, SAMPLES_DIR)
    if os.path.isdir(samples) and os.listdir(samples):
        found.append(SAMPLES_DIR + "/")
    for name in sorted(os.listdir(output_dir)):
        path = os.path.join(output_dir, name)
        if os.path.isdir(path) and not os.path.islink(path) and (
                _is_tracker_folder(path) or name.startswith(checkpoints.ABANDONED_PREFIX)):
            found.append(name + "/")
    return sorted(found)


def _is_tracker_folder(path: str) -> bool:
    """A folder holding nothing but tensorboard event files (and accelerate's ``hparams.yml``), at least one."""
    events = 0
    for root, dirs, names in os.walk(path):
        if any(os.path.islink(os.path.join(root, d)) for d in dirs):
            return False
        for name in names:
            if os.path.islink(os.path.join(root, name)) or not _TRACKER_FILE.fullmatch(name):
                return False
            events += name.startswith("events.out.tfevents.")
    return events > 0


def _pipeline_components(output_dir: str) -> list[str]:
    """The component folders a saved pipeline's ``model_index.json`` names the way diffusers writes them: a plain
    name (never a path such as ``../x``) mapped to ``[library, class]``."""
    try:
        with open(os.path.join(output_dir, PIPELINE_INDEX), encoding="utf-8") as f:
            index = json.load(f)
    except (OSError, ValueError):
        return []
    if not isinstance(index, dict):
        return []
    return [k for k, v in index.items() if not k.startswith("_") and _COMPONENT.fullmatch(k)
            and isinstance(v, list) and len(v) == 2]


def _remove(output_dir: str, name: str) -> bool:
    """Delete ``output_dir/name``: only a single plain name directly inside ``output_dir``; a symlink is unlinked
    (its target is kept); a folder only if it really lies inside ``output_dir``. Returns whether it was removed."""
    if not name or name in (".", "..") or os.sep in name or (os.altsep and os.altsep in name):
        return False
    path = os.path.join(output_dir, name)
    if os.path.islink(path):
        os.unlink(path)
    elif os.path.isdir(path):
        if os.path.dirname(os.path.realpath(path)) != os.path.realpath(output_dir):
            return False
        shutil.rmtree(path)
    elif os.path.isfile(path):
        os.remove(path)
    else:
        return False
    return True


def foreign_pipeline(output_dir: str) -> list[str]:
    """What a diffusers pipeline that no trl_flow run wrote holds in ``output_dir`` (``model_index.json`` and its
    component folders: a base model someone gave as output_dir), or [] if there is none. A trl_flow run leaves its
    ``log_history.jsonl`` (written at every start) or its checkpoints next to the pipeline it saves."""
    if not os.path.isfile(os.path.join(output_dir, PIPELINE_INDEX)):
        return []
    comps = [c + "/" for c in _pipeline_components(output_dir) if os.path.isdir(os.path.join(output_dir, c))]
    if not comps or os.path.exists(os.path.join(output_dir, LOG_NAME)):
        return []
    if checkpoints.find_checkpoints(output_dir)[0]:
        return []
    return [PIPELINE_INDEX] + comps


def removal_list(output_dir: str, run_id: str) -> list[str]:
    """Every path :func:`remove_earlier_outputs` would remove, as it would remove it: the names of
    :func:`earlier_outputs` and a saved pipeline's component folders, folders ending in ``/``, symlinks marked
    ``(symlink, its target is kept)``."""
    listed = []
    for name in earlier_outputs(output_dir, run_id):
        if name == PIPELINE_INDEX:
            listed += [c for c in _pipeline_components(output_dir) if os.path.lexists(os.path.join(output_dir, c))]
        listed.append(name.rstrip("/"))
    out = []
    for name in listed:
        path = os.path.join(output_dir, name)
        out.append(name + (" (symlink, its target is kept)" if os.path.islink(path) else
                           "/" if os.path.isdir(path) else ""))
    return out


def remove_earlier_outputs(output_dir: str, run_id: str) -> list[str]:
    """Delete what :func:`earlier_outputs` lists (a saved pipeline: its ``model_index.json`` and the component
    folders it names), each by name inside ``output_dir`` (:func:`_remove`). Returns the names removed."""
    names = earlier_outputs(output_dir, run_id)
    for name in names:
        if name == PIPELINE_INDEX:
            for comp in _pipeline_components(output_dir):
                _remove(output_dir, comp)
        _remove(output_dir, name.rstrip("/"))
    return names


# ------------------------------------------------------------------------------------------------------- lock
def acquire_lock(output_dir: str):
    """Take the exclusive lock of ``output_dir`` (created if missing) without waiting. Returns the open lock file
    descriptor (None where the file system has no locks: a warning), or raises ``RuntimeError`` naming the run
    that holds it."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        return None
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, LOCK_NAME)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = json.loads(os.pread(fd, 4096, 0).decode("utf-8") or "{}")
        except ValueError:
            holder = {}
        os.close(fd)
        who = (f"process {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}"
               if holder.get("pid") else "another process")
        raise RuntimeError(
            f"output_dir={output_dir!r} is in use by another trl_flow run ({who}; it holds {path}): two runs in one "
            "folder would mix their checkpoints and log. Wait for it to end or stop it, or choose another "
            "output_dir") from None
    except OSError as e:  # e.g. a network file system without flock
        os.close(fd)
        warnings.warn(f"output_dir={output_dir!r}: cannot lock {path} ({e}); nothing stops a second run from using "
                      "this folder at the same time", RuntimeWarning, stacklevel=2)
        return None
    info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(info).encode("utf-8"), 0)
    return fd


def release_lock(fd) -> None:
    """Release a lock from :func:`acquire_lock` (closing the descriptor releases it; the file stays)."""
    if fd is not None:
        os.close(fd)


@contextlib.contextmanager
def run_lock(trainer):
    """Hold ``output_dir``'s lock (main process) for a ``train()``; every process raises if it is taken."""
    cfg, acc = trainer.config, trainer.accelerator
    fd, error = None, None
    if acc.is_main_process:
        try:
            fd = acquire_lock(cfg.output_dir)
        except RuntimeError as e:
            error = str(e)
    error = distributed.agree(acc, error)
    if error:
        release_lock(fd)
        raise RuntimeError(error)
    try:
        yield
    finally:
        release_lock(fd)


def prepare(trainer, resume) -> None:
    """At the start of ``train()``: resume (``resume`` = True / a folder, see
    :func:`~trl_flow.engine.checkpoints.normalize_resume`; later checkpoints of the resumed run are moved aside
    by :func:`~trl_flow.engine.checkpoints.set_aside_later`), or check that ``output_dir`` holds no earlier run's
    outputs (removing them with ``overwrite_output_dir=True``); then clean interrupted saves and rewrite the log.
    ``train()`` has checked ``output_dir`` with :func:`check_writable` and taken its lock (:func:`run_lock`)."""
    cfg, acc = trainer.config, trainer.accelerator
    resume = checkpoints.normalize_resume(resume)
    if resume is True and distributed.agree(acc, "fresh" if checkpoints.nothing_to_resume(resume, cfg.output_dir)
                                            else None):
        acc.print(f"resume_from_checkpoint=True: no checkpoint in {cfg.output_dir} yet, so this is a new run")
        resume = None
    if resume is not None:
        trainer.load_checkpoint(resume)
        acc.wait_for_everyone()
        if acc.is_main_process:  # the resumed run owns the steps after its start
            dest, moved = checkpoints.set_aside_later(cfg.output_dir, trainer.state.run_id, trainer.state.global_step)
            if moved:
                acc.print(f"This run continues from step {trainer.state.global_step}, so the later checkpoints of "
                          f"the branch it leaves ({', '.join(moved)}) were moved to {dest} (nothing was deleted; "
                          "resume_from_checkpoint=True now finds this run's own checkpoints; delete that folder "
                          "when you no longer need it)")
    elif not getattr(trainer, "_output_dir_ready", False) and trainer.state.global_step == 0:
        refuse_foreign_pipeline(cfg.output_dir)
        found = earlier_outputs(cfg.output_dir, trainer.state.run_id)
        if found and not cfg.overwrite_output_dir:
            resumable = any(checkpoints.read_marker(os.path.join(cfg.output_dir, n)) for n in found
                            if n.startswith("checkpoint-"))
            resume_hint = ("pass resume_from_checkpoint=True to continue its newest checkpoint, or pass " if resumable
                           else "it has no complete checkpoint to resume from: pass ")
            raise ValueError(
                f"output_dir={cfg.output_dir!r} already holds an earlier run's outputs ({', '.join(found)}); "
                f"{resume_hint}overwrite_output_dir=True to delete them and start a new run there, or choose "
                "another output_dir")
        acc.wait_for_everyone()
        if found and acc.is_main_process:
            announce_removal(trainer)
            remove_earlier_outputs(cfg.output_dir, trainer.state.run_id)
            acc.print(f"overwrite_output_dir: removed the earlier run's {', '.join(found)} from {cfg.output_dir}")
    trainer._output_dir_ready = True
    if acc.is_main_process:
        os.makedirs(cfg.output_dir, exist_ok=True)
        checkpoints.clean_leftovers(cfg.output_dir)
        write_log(os.path.join(cfg.output_dir, LOG_NAME), trainer.state.log_history, mode="w")
    acc.wait_for_everyone()


def refuse_foreign_pipeline(output_dir: str) -> None:
    """Refuse an ``output_dir`` holding a pipeline no trl_flow run wrote, even with ``overwrite_output_dir``: the
    overwrite would delete someone's model (e.g. the base model's own folder)."""
    held = foreign_pipeline(output_dir)
    if held:
        raise ValueError(
            f"output_dir={output_dir!r} holds a diffusers pipeline that no trl_flow run wrote ({', '.join(held)}), "
            "e.g. the base model itself; it is never overwritten, not even with overwrite_output_dir=True (that "
            "would delete the model): choose another output_dir")


def announce_removal(trainer) -> list[str]:
    """Say (console and the ``trl_flow`` logger) every path overwrite_output_dir is about to remove, before it does."""
    import logging

    cfg = trainer.config
    paths = removal_list(cfg.output_dir, trainer.state.run_id)
    note = f"overwrite_output_dir: removing from {cfg.output_dir}: {', '.join(paths)}"
    trainer.accelerator.print(note)
    logging.getLogger("trl_flow").warning(note)
    return paths


def json_safe(entry: dict) -> dict:
    """A log entry strict JSON readers accept: NaN and +-inf become ``null`` (Python's ``json`` would write bare
    ``NaN`` / ``Infinity``)."""
    return {k: (None if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf"))) else v)
            for k, v in entry.items()}


def write_log(path: str, entries: list[dict], mode: str = "a") -> None:
    """Append (or with ``mode="w"`` rewrite) ``log_history.jsonl``: one strict-JSON object per line."""
    with open(path, mode, encoding="utf-8") as f:
        for entry in entries:
            f.write(json.dumps(json_safe(entry), allow_nan=False) + "\n")
