"""The output folder of a run: writable before any compute, and never mixing two runs.

A new (not resumed) run refuses an ``output_dir`` that holds any earlier run's outputs: its checkpoints, and also a
finished run without checkpoints (the final LoRA or pipeline, ``log_history.jsonl``, ``samples/``). Resuming
continues that run; ``overwrite_output_dir=True`` first removes those outputs, so nothing of two runs mixes.
Nothing else in the folder is touched.
"""

from __future__ import annotations

import json
import os
import shutil

from . import checkpoints

LOG_NAME = "log_history.jsonl"
SAMPLES_DIR = "samples"
PIPELINE_INDEX = "model_index.json"


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
    pipeline, a non-empty log, sample grids. ``.tmp`` folders of interrupted saves are not listed (they are
    deleted at every start)."""
    if not os.path.isdir(output_dir):
        return []
    complete, incomplete = checkpoints.find_checkpoints(output_dir)
    found = [os.path.basename(c.path) for c in complete if c.run_id != run_id]
    found += [os.path.basename(p) for p in incomplete if not p.endswith(checkpoints.TMP_SUFFIX)]
    for name in (checkpoints.LORA_WEIGHT_NAME, PIPELINE_INDEX):
        if os.path.isfile(os.path.join(output_dir, name)):
            found.append(name)
    log = os.path.join(output_dir, LOG_NAME)
    if os.path.isfile(log) and os.path.getsize(log) > 0:
        found.append(LOG_NAME)
    samples = os.path.join(output_dir, SAMPLES_DIR)
    if os.path.isdir(samples) and os.listdir(samples):
        found.append(SAMPLES_DIR + "/")
    return sorted(found)


def remove_earlier_outputs(output_dir: str, run_id: str) -> list[str]:
    """Delete what :func:`earlier_outputs` lists (a saved pipeline: its ``model_index.json`` and component
    folders). Returns the names removed."""
    names = earlier_outputs(output_dir, run_id)
    for name in names:
        path = os.path.join(output_dir, name.rstrip("/"))
        if name == PIPELINE_INDEX:
            try:
                with open(path, encoding="utf-8") as f:
                    components = [k for k in json.load(f) if not k.startswith("_")]
            except (OSError, ValueError):
                components = []
            for comp in components:
                if os.path.isdir(os.path.join(output_dir, comp)):
                    shutil.rmtree(os.path.join(output_dir, comp))
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    return names


def prepare(trainer, resume) -> None:
    """At the start of ``train()``: resume (``resume`` = True / a folder, see
    :func:`~trl_flow.trainers.checkpoints.normalize_resume`), or check that ``output_dir`` holds no earlier run's
    outputs (removing them with ``overwrite_output_dir=True``); then clean interrupted saves and rewrite the log."""
    cfg, acc = trainer.config, trainer.accelerator
    check_writable(cfg.output_dir)
    resume = checkpoints.normalize_resume(resume)
    if resume is not None:
        trainer.load_checkpoint(resume)
    elif not getattr(trainer, "_output_dir_ready", False) and trainer.state.global_step == 0:
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
            remove_earlier_outputs(cfg.output_dir, trainer.state.run_id)
            acc.print(f"overwrite_output_dir: removed the earlier run's {', '.join(found)} from {cfg.output_dir}")
    trainer._output_dir_ready = True
    if acc.is_main_process:
        os.makedirs(cfg.output_dir, exist_ok=True)
        checkpoints.clean_leftovers(cfg.output_dir)
        write_log(os.path.join(cfg.output_dir, LOG_NAME), trainer.state.log_history, mode="w")
    acc.wait_for_everyone()


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
