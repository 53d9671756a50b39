"""The training loop of every trainer: lock and prepare ``output_dir``, iterate, checkpoint, evaluate, save the
final model, push; transformers' callbacks at the points a transformers user expects (:mod:`.callbacks`).

After each iteration (``on_step_end`` sets the flags: the config's schedule, then the trainer's callbacks), in this
order: log (``should_log``); ``checkpoint-<step>`` (``should_save``); the final model into ``output_dir`` after the
last iteration, or after the one a callback stops at (``should_training_stop``); the evaluation
(``should_evaluate``); then a deferred SIGINT / SIGTERM is honoured. Saving comes
before evaluating, so an evaluation that fails never costs the checkpoint or the final model of its step; a run
resumed at a step whose evaluation is due and missing from the restored log evaluates first. The final model is
saved locally before any push, so a Hub failure never costs the weights. SIGINT / SIGTERM stay deferred during the
final save: a first signal lets it finish.
"""

from __future__ import annotations

import os

from ..rewards import RewardError
from ..storage import SaveError
from . import callbacks, checkpoints, distributed, export, final_save
from . import output_dir as run_dir
from .interrupts import InterruptGuard
from .preemption import PreemptionCheckpoint


def train(trainer, resume_from_checkpoint=None):
    """:meth:`FlowRLTrainer.train`."""
    cfg, acc = trainer.config, trainer.accelerator
    resume = resume_from_checkpoint if resume_from_checkpoint is not None else cfg.resume_from_checkpoint
    run_dir.check_writable(cfg.output_dir)
    final_save.check_free_space(trainer)  # the final weights must fit (check_free_space=False goes on)
    with run_dir.run_lock(trainer):  # a second run in this output_dir is refused here
        run_dir.prepare(trainer, resume)  # resume, or refuse / (overwrite_output_dir) clear an earlier run's outputs
        if cfg.report_to:
            acc.init_trackers(cfg.run_name or trainer._method_name, config=checkpoints.flat_config(cfg))
        try:
            _iterate(trainer)
            trainer.model.eval()
            callbacks.fire(trainer, "on_train_end")
            if cfg.push_to_hub:
                callbacks.fire(trainer, "on_push_begin")
                trainer.push_to_hub()
        finally:
            # the trackers end with the run; the process group does not (accelerate's end_training() would
            # destroy it, and the caller's next collective -- save_model, push_to_hub -- would fail)
            for tracker in acc.trackers if cfg.report_to else ():
                tracker.finish()
    return trainer.state


def _iterate(trainer) -> None:
    from tqdm.auto import tqdm

    cfg, acc = trainer.config, trainer.accelerator
    start = trainer.state.global_step
    bar = tqdm(total=cfg.max_steps, initial=start, desc=trainer._method_name,
               disable=cfg.disable_tqdm or not acc.is_local_main_process)
    callbacks.train_begin(trainer)
    if callbacks.eval_due(cfg, start) and not _evaluated(trainer, start):
        _evaluate(trainer, start)
    # SIGINT / SIGTERM are deferred to the end of the iteration, which is then saved: a checkpoint never holds
    # part of an iteration. Anything raised mid-iteration (a failing reward, a second Ctrl-C) saves nothing.
    # A SIGTERM also writes the last completed iteration at once (the scheduler may SIGKILL before its end).
    preempt = PreemptionCheckpoint(trainer)
    guard = InterruptGuard(acc.print, on_first_signal=preempt.on_signal)
    try:
        with guard:
            for step in range(start, cfg.max_steps):
                callbacks.fire(trainer, "on_step_begin")
                try:
                    metrics = trainer.training_iteration(step)
                except RewardError as e:
                    raise RewardError(f"iteration {step + 1}: {e}; {_kept(trainer)}") from e
                except KeyboardInterrupt:
                    preempt.wait(10.0)  # the message names the preemption checkpoint once it is complete
                    raise _interrupted(trainer, f"interrupted during iteration {step + 1}: its partial update is "
                                                "discarded") from None
                n = trainer.state.global_step = step + 1
                trainer._no_reward.update(metrics, step)
                bar.update(1)
                bar.set_postfix(reward=f"{metrics.get('reward', float('nan')):.4g}")
                callbacks.fire(trainer, "on_step_end")
                final = _after_iteration(trainer, metrics, n)
                preempt.record()
                signum = guard.stop_requested(acc)
                if signum:
                    if final:
                        note = f"the final model is saved in {cfg.output_dir}" + (
                            " (not pushed to the Hub)" if cfg.push_to_hub else "")
                        acc.print(f"Training finished ({n} iterations): {note}; stopping.")
                    else:
                        preempt.wait()
                        saved = callbacks.save_checkpoint(trainer)
                        preempt.drop_superseded(saved)
                        note = f"saved {saved} after iteration {n}"
                        acc.print(f"{note[0].upper()}{note[1:]}; stopping.")
                    exc = guard.exception(signum)
                    raise (KeyboardInterrupt(note + "; " + _kept(trainer)) if isinstance(exc, KeyboardInterrupt)
                           else exc)
                if final:
                    if n < cfg.max_steps:
                        acc.print(f"Training stopped by a callback after iteration {n} of {cfg.max_steps}: the "
                                  f"final model is saved in {cfg.output_dir}")
                    break
            if start >= cfg.max_steps:  # resumed at the end: nothing to iterate, the final model is still saved
                save_final(trainer)
    finally:
        preempt.wait(10.0)  # a preemption checkpoint being written completes even when "stop now" ends the loop
        bar.close()


def _after_iteration(trainer, metrics: dict, n: int) -> bool:
    """Honour the flags ``on_step_end`` set (log, checkpoint, final model, evaluation), and those the callbacks set
    on the way (``on_log``, ``on_save``, ``on_evaluate``). Returns whether the run ends here (the final model is
    then saved)."""
    last = n >= trainer.config.max_steps  # the run ends at max_steps whatever a callback set
    control = callbacks.agree(trainer)
    if control.should_log or control.should_training_stop or last:  # the last iteration of a run is always logged
        callbacks.log(trainer, metrics, n)
        control = callbacks.agree(trainer)
    if control.should_save:
        callbacks.save_checkpoint(trainer)
        control = callbacks.agree(trainer)
    final = control.should_training_stop or last
    if final:
        save_final(trainer)
    if control.should_evaluate:
        _evaluate(trainer, n)
        control = callbacks.agree(trainer)
        if control.should_save:  # asked for by on_log / on_evaluate of the evaluation
            callbacks.save_checkpoint(trainer)
            control = callbacks.agree(trainer)
        if control.should_training_stop and not final:
            save_final(trainer)
            final = True
    return final


def _evaluated(trainer, n: int) -> bool:
    return any(h.get("step") == n and "eval/reward" in h for h in trainer.state.log_history)


def _evaluate(trainer, n: int) -> None:
    try:
        metrics = trainer.evaluate()
    except RewardError as e:
        raise RewardError(f"evaluation at iteration {n}: {e}; {_kept(trainer)}") from e
    callbacks.log(trainer, metrics, n)
    callbacks.fire(trainer, "on_evaluate", metrics=metrics)


def _kept(trainer) -> str:
    return checkpoints.kept_note(trainer.config.output_dir)


def _interrupted(trainer, what: str) -> KeyboardInterrupt:
    """A KeyboardInterrupt whose message says what is on disk (the command line prints it)."""
    note = f"{what}; {_kept(trainer)}"
    trainer.accelerator.print(note[0].upper() + note[1:])
    return KeyboardInterrupt(note)


# ---------------------------------------------------------------------------------------------- final model
def save_final(trainer) -> None:
    """Save the final model into ``output_dir`` (atomically; SIGINT / SIGTERM deferred by the loop's guard). A
    failure or a second interrupt says what is and is not on disk; the trained weights stay in the trainer."""
    out = trainer.config.output_dir
    try:
        trainer.save_model(out)
    except SaveError as e:
        rescued, failures = final_save.save_to_rescue_folder(trainer)
        if rescued:
            raise SaveError(
                f"{e}. The trained weights were written to the fallback folder {rescued} instead (copy them into "
                f"{out} once it has room); on disk, {_kept(trainer)}") from e.__cause__
        raise SaveError(
            f"{e}. The trained weights are still in this trainer's memory: make room, then call "
            f"trainer.save_model() (from the command line they are lost when the process ends; the fallback "
            f"folders failed too: {'; '.join(failures)}); on disk, {_kept(trainer)}") from e.__cause__
    except KeyboardInterrupt:
        raise _interrupted(trainer, f"interrupted while saving the final model: nothing of it was kept in {out} "
                                    "(the save was atomic)") from None


def save_model(trainer, output_dir: str | None = None) -> str:
    """:meth:`FlowRLTrainer.save_model`: returns at once when this trainer already wrote the weights of the same
    step into the same folder (``train()`` saves the final model; a later ``save_model()`` or ``push_to_hub()``
    then writes nothing again)."""
    target = output_dir or trainer.config.output_dir
    main_file = trainer.adapter.lora_weight_names()[0] if trainer.config.finetune == "lora" else run_dir.PIPELINE_INDEX
    key = (os.path.realpath(target), trainer.state.global_step)
    if getattr(trainer, "_saved_model", None) == key:  # the main process decides: it is the one that wrote
        acc = trainer.accelerator
        missing = None if not acc.is_main_process or os.path.isfile(os.path.join(target, main_file)) else "gone"
        if distributed.agree(acc, missing) is None:
            return target
    run_dir.check_writable(target, "save_model(output_dir)")
    export.save_model(trainer, target)
    trainer._saved_model = key
    return target
