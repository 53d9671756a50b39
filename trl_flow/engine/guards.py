"""Checks a trainer runs before spending compute, and monitors of a running loop.

Each check raises an error naming the field (or object) and the fix; each monitor logs a counted skip and warns
loudly when a problem persists.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings

#: Iterations in a row without any rewarded sample after which the loop warns (and again every as many).
NO_REWARD_WARN_AFTER = 3


# ------------------------------------------------------------------------------------------- launch, batch
def check_launch(accelerator) -> None:
    """A launcher that started several processes (WORLD_SIZE > 1) must give accelerate as many: on a machine without
    GPUs accelerate otherwise runs independent single-process copies that write into one output_dir. (The start-up
    line of :func:`trl_flow.engine.distributed.startup_line` says how many processes a run has.)"""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world > 1 and accelerator.num_processes == 1:
        raise RuntimeError(
            f"launched with WORLD_SIZE={world} but accelerate runs 1 process per copy (no GPU found, so it does not "
            "set up torch.distributed): on CPU set ACCELERATE_USE_CPU=1, e.g. `ACCELERATE_USE_CPU=1 torchrun "
            f"--nproc_per_node {world} train.py ...` or `ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu "
            f"--num_processes {world} train.py ...`"
        )


def _nearest(value: int, ok) -> list[int]:
    """The closest integers >= 1 below and above ``value`` for which ``ok`` holds."""
    lo = next((v for v in range(value - 1, 0, -1) if ok(v)), None)
    hi = next((v for v in range(value + 1, value * 64 + 64) if ok(v)), None)
    return [v for v in (lo, hi) if v is not None]


def check_batch(config, num_processes: int) -> None:
    """``prompts_per_step * num_generations`` trajectories must split evenly over the processes."""
    P, G, n = config.prompts_per_step, config.num_generations, num_processes
    if (P * G) % n == 0:
        return
    ps = _nearest(P, lambda p: (p * G) % n == 0)
    gs = _nearest(G, lambda g: g >= 2 and (P * g) % n == 0)
    options = [f"prompts_per_step={p} ({p * G} trajectories, {p * G // n} per process)" for p in ps]
    options += [f"num_generations={g} ({P * g} trajectories, {P * g // n} per process)" for g in gs]
    raise ValueError(
        f"prompts_per_step={P} x num_generations={G} = {P * G} trajectories per iteration cannot be split evenly "
        f"over {n} processes ({P * G} / {n} = {P * G / n:.3g}); nearest valid: " + ", or ".join(options)
        + f", or a number of processes that divides {P * G}"
    )


# ------------------------------------------------------------------------------------------------- pipeline
def check_no_adapter(transformer, name: str = "transformer") -> None:
    """The trainer adds its own LoRA adapter ``default``: a transformer (``pipe.<name>``) that already holds one (a
    pipeline given to a trainer before, or with loaded LoRA weights) is refused with the fix."""
    names = list(getattr(transformer, "peft_config", None) or {})
    if names:
        raise ValueError(
            f"pipe.{name} already holds LoRA adapter(s) {names}: this pipeline was given to a trainer before, or "
            "has LoRA weights loaded. Build or load a fresh pipeline for each trainer; to start from a LoRA, merge "
            "it first: pipe.fuse_lora(); pipe.unload_lora_weights()"
        )
    if getattr(transformer, "_hf_peft_config_loaded", False):  # left over by a failed add_adapter: harmless now
        transformer._hf_peft_config_loaded = False


def remove_adapter(transformer) -> None:
    """Undo the trainer's ``add_adapter`` after a failed set-up, so that the pipeline can be given to a new trainer."""
    if "default" in (getattr(transformer, "peft_config", None) or {}):
        transformer.delete_adapters("default")
    if not getattr(transformer, "peft_config", None):
        transformer._hf_peft_config_loaded = False


# ---------------------------------------------------------------------------------------------------- prompts
def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a ``warnings.warn`` in the calling function point at the user's code: the first
    frame outside trl_flow and torch (``torch.no_grad``'s wrapper, torch/utils/_contextlib.py, sits between a
    trainer's ``encode`` and its caller)."""
    import os
    import sys

    import torch

    skip = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (sys.modules["trl_flow"], torch))
    frame, level = sys._getframe(1), 1  # level 1: the function that calls warnings.warn
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(skip):
        frame, level = frame.f_back, level + 1
    return level


class LongPromptWarning:
    """Warn once per trainer when a prompt is longer than a text encoder's limit (the pipeline cuts it there), naming
    its dataset row, and silence the pipeline's own warning, which it repeats at every encode. The limits and the
    token counts are the adapter's (:meth:`~trl_flow.models.FlowAdapter.prompt_token_limits`), as its pipeline
    counts and cuts."""

    def __init__(self, adapter, max_sequence_length: int, datasets: dict | None = None):
        self.adapter = adapter
        self.max_sequence_length = max_sequence_length
        self.limits = adapter.prompt_token_limits(max_sequence_length)
        self.datasets = {name: ds for name, ds in (datasets or {}).items() if ds is not None}
        self.logger = logging.getLogger(type(adapter.pipe).__module__)
        self.warned = False

    def check(self, prompts: list[str]) -> None:
        if self.warned or not self.limits:
            return
        distinct = list(dict.fromkeys(prompts))
        for name, limit in self.limits.items():
            lengths = self.adapter.prompt_token_counts(distinct, name)
            long = [i for i, n in enumerate(lengths) if n > limit]
            if long:
                self.warned = True
                first = distinct[long[0]]
                raisable = self.adapter.prompt_token_limits(self.max_sequence_length + 1).get(name) != limit
                fix = ("Shorten them or raise max_sequence_length." if raisable
                       else "Shorten them (this limit does not change with max_sequence_length).")
                warnings.warn(
                    f"{len(long)} of {len(distinct)} distinct prompts in this batch exceed the {limit}-token limit of "
                    f"pipe.{name} and are cut there by the pipeline: e.g. {self._where(first, prompts)}, "
                    f"{lengths[long[0]]} tokens: {first[:80]!r}. {fix} Reported once per trainer.",
                    UserWarning, stacklevel=user_stacklevel())
                return

    def _where(self, prompt: str, prompts: list[str]) -> str:
        """The prompt's first dataset row ("train_dataset row 12"), else its place in the batch."""
        for name, ds in self.datasets.items():
            column = ds["prompt"]
            try:
                return f"{name} row {list(column).index(prompt)}"
            except ValueError:
                continue
        return f"prompt {prompts.index(prompt)} of the batch"

    @contextlib.contextmanager
    def silence_pipeline(self):
        class _DropTruncation(logging.Filter):
            def filter(self, record):
                return "was truncated" not in record.getMessage()

        f = _DropTruncation()
        self.logger.addFilter(f)
        try:
            yield
        finally:
            self.logger.removeFilter(f)


# ---------------------------------------------------------------------------------------------------- rewards
class NoRewardMonitor:
    """Counts iterations in which no sample got a reward (all None / NaN / inf: no update) and warns loudly after
    :data:`NO_REWARD_WARN_AFTER` in a row."""

    def __init__(self):
        self.streak = 0
        self.skipped = 0
        self.nonfinite = 0.0

    def update(self, metrics: dict, step: int) -> None:
        nonfinite = float(metrics.get("nonfinite_skipped", self.nonfinite))
        if nonfinite > self.nonfinite:  # a non-finite loss or gradient: that update was skipped, say so
            warnings.warn(f"iteration {step + 1}: {nonfinite - self.nonfinite:g} non-finite loss / gradient "
                          f"update(s) skipped (nonfinite_skipped={nonfinite:g}); check the rewards and the "
                          "learning rate", RuntimeWarning, stacklevel=3)
        self.nonfinite = nonfinite
        if metrics.get("no_reward_frac", 0.0) < 1.0:
            self.streak = 0
        else:
            self.streak += 1
            self.skipped += 1
            if self.streak % NO_REWARD_WARN_AFTER == 0:
                warnings.warn(
                    f"iteration {step + 1}: no sample got a reward for {self.streak} iterations in a row (every "
                    "reward returned None, NaN or inf), so nothing was trained. Check the reward functions.",
                    RuntimeWarning, stacklevel=3)
        metrics["skipped_no_reward"] = float(self.skipped)
