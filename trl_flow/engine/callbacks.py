"""Callbacks: transformers' own ``TrainerCallback``, ``TrainerState``, ``TrainerControl`` and ``CallbackHandler``
around the training loop, as every transformers / TRL trainer calls them.

``trainer.callback_handler`` holds :class:`RunFlowCallback` first, then the trainer's ``callbacks``;
``trainer.control`` is the ``TrainerControl``; ``trainer.state`` is a ``transformers.TrainerState``
(:func:`~trl_flow.engine.checkpoints.transformers_state`). ``args`` is the trainer's config. The events and where
they fire:

- ``on_init_end``: at the end of the trainer's ``__init__``;
- ``on_train_begin``: in ``train()``, once ``output_dir`` is prepared (and a checkpoint restored), before the first
  iteration; ``state.max_steps``, ``logging_steps``, ``eval_steps``, ``save_steps``, ``train_batch_size`` are set;
- ``on_step_begin`` / ``on_step_end``: around each iteration (rollout, rewards, update); at ``on_step_end``
  ``state.global_step`` is the iteration's number and :class:`RunFlowCallback` has set the flags of the config's
  schedule (``logging_steps``, ``save_steps``, ``eval_steps``, ``max_steps``);
- ``on_log``: after a metrics entry (an iteration's, or an evaluation's) is appended to ``state.log_history``;
  ``logs`` is the entry without its ``step``;
- ``on_save``: after a ``checkpoint-<step>`` is written;
- ``on_evaluate``: after an evaluation (``metrics``: its ``eval/*`` entries, logged just before);
- ``on_train_end``: after the final model is saved into ``output_dir``; ``on_push_begin``: before ``train()``
  pushes it (``push_to_hub``).

The flags, after each iteration, in the loop's order: ``should_log`` logs the iteration's metrics;
``should_save`` writes a checkpoint; ``should_training_stop`` ends the run after this iteration, saving the final
model as at ``max_steps``; ``should_evaluate`` evaluates (a flag that ``on_log`` / ``on_evaluate`` set is honoured
in the same iteration: a checkpoint, or the stop). With several processes the main process's flags decide. There
are no epochs: ``on_epoch_*``, ``on_substep_end``, ``on_*optimizer_step`` and ``on_prediction_step`` never fire.
Callbacks that are ``transformers.trainer_callback.ExportableState`` are saved with each checkpoint and restored on
resume, as transformers does.
"""

from __future__ import annotations

from . import checkpoints

#: The flags of ``TrainerControl`` that the loop reads (with several processes, the main process's decide).
FLAGS = ("should_training_stop", "should_save", "should_evaluate", "should_log")


def eval_due(cfg, n: int) -> bool:
    """Whether the config's schedule evaluates after iteration ``n`` (0: before the first)."""
    return bool(cfg.eval_steps) and (n == 0 or n % cfg.eval_steps == 0 or n == cfg.max_steps)


def _flow_callback_class():
    from transformers.trainer_callback import DefaultFlowCallback

    class RunFlowCallback(DefaultFlowCallback):
        """transformers' default flow for a trl_flow config: sets ``should_log`` every ``logging_steps`` and at the
        last iteration, ``should_save`` every ``save_steps``, ``should_evaluate`` when ``eval_steps`` is due, and
        ``should_training_stop`` at ``max_steps`` (``DefaultFlowCallback`` reads ``TrainingArguments``' strategies,
        which a trl_flow config has not)."""

        def on_step_end(self, args, state, control, **kwargs):
            n = state.global_step
            if n % args.logging_steps == 0 or n >= state.max_steps:
                control.should_log = True
            if args.save_steps and n % args.save_steps == 0:
                control.should_save = True
            if eval_due(args, n):
                control.should_evaluate = True
            if n >= state.max_steps:
                control.should_training_stop = True
            return control

        def on_epoch_end(self, args, state, control, **kwargs):
            return control  # a trl_flow run has no epochs

    return RunFlowCallback


def __getattr__(name):  # RunFlowCallback is built on first use: it imports transformers
    if name == "RunFlowCallback":
        cls = globals()["RunFlowCallback"] = _flow_callback_class()
        cls.__module__, cls.__qualname__ = __name__, name
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check_callbacks(callbacks) -> list:
    """``callbacks``: None or a list of ``transformers.TrainerCallback`` instances or classes (a class is
    instantiated, as transformers does); anything else raises ``TypeError`` naming it."""
    from transformers import TrainerCallback

    if callbacks is None:
        return []
    if isinstance(callbacks, (TrainerCallback, type)) or not isinstance(callbacks, (list, tuple)):
        raise TypeError(f"callbacks: expected a list of transformers.TrainerCallback, got {type(callbacks).__name__}")
    for cb in callbacks:
        ok = issubclass(cb, TrainerCallback) if isinstance(cb, type) else isinstance(cb, TrainerCallback)
        if not ok:
            raise TypeError(f"callbacks: {cb!r} is not a transformers.TrainerCallback (subclass it and override the "
                            "on_* events it needs)")
    return list(callbacks)


def attach(trainer, callbacks=None) -> None:
    """At the end of the trainer's ``__init__``: ``trainer.state`` as a ``transformers.TrainerState``,
    ``trainer.control``, ``trainer.callback_handler`` (:class:`RunFlowCallback`, then ``callbacks``); fires
    ``on_init_end``."""
    from transformers import TrainerControl
    from transformers.trainer_callback import CallbackHandler

    user = check_callbacks(callbacks)
    trainer.state = checkpoints.transformers_state(trainer.state)
    _fill_state(trainer)
    trainer.control = TrainerControl()
    tokenizer = getattr(getattr(trainer, "pipe", None), "tokenizer", None)
    trainer.callback_handler = CallbackHandler([__getattr__("RunFlowCallback"), *user], trainer.model, tokenizer,
                                               trainer.optimizer, trainer.lr_scheduler)
    fire(trainer, "on_init_end")


def _fill_state(trainer) -> None:
    cfg, acc, state = trainer.config, trainer.accelerator, trainer.state
    state.max_steps, state.logging_steps = cfg.max_steps, cfg.logging_steps
    state.eval_steps, state.save_steps = cfg.eval_steps, cfg.save_steps
    state.train_batch_size = cfg.train_batch_size
    state.is_local_process_zero, state.is_world_process_zero = acc.is_local_main_process, acc.is_main_process


def fire(trainer, event: str, **kwargs):
    """Call ``event`` on every callback (``args`` = the config); returns the (new) ``trainer.control``."""
    if getattr(trainer, "callback_handler", None) is None:  # a trainer built without attach (a subclass's own init)
        attach(trainer)
    handler = trainer.callback_handler
    handler.model, handler.optimizer, handler.lr_scheduler = trainer.model, trainer.optimizer, trainer.lr_scheduler
    control = getattr(handler, event)(trainer.config, trainer.state, trainer.control, **kwargs)
    trainer.control = control if control is not None else trainer.control
    return trainer.control


def agree(trainer):
    """The main process's flags on every process (callbacks may decide differently per process; a checkpoint, an
    evaluation and the stop are collective). Returns ``trainer.control``."""
    acc, control = trainer.accelerator, trainer.control
    if acc.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        flags = broadcast_object_list([[getattr(control, f) for f in FLAGS]])[0]
        for name, value in zip(FLAGS, flags):
            setattr(control, name, bool(value))
    return control


def train_begin(trainer) -> None:
    """After ``output_dir`` is prepared (a resumed state restored): fill the state, restore the callbacks' saved
    state, fire ``on_train_begin``."""
    if getattr(trainer, "callback_handler", None) is None:
        attach(trainer)
    trainer.state = checkpoints.transformers_state(trainer.state)
    _fill_state(trainer)
    _restore_states(trainer)
    fire(trainer, "on_train_begin")


def log(trainer, metrics: dict, step: int) -> None:
    """``trainer.log`` (the log history, trackers, ``log_history.jsonl``), then ``on_log``."""
    trainer.log(metrics, step)
    entry = trainer.state.log_history[-1] if trainer.state.log_history else {}
    fire(trainer, "on_log", logs={k: v for k, v in entry.items() if k != "step"})


def save_checkpoint(trainer) -> str:
    """The callbacks' exportable state into the trainer state, ``trainer.save_checkpoint()``, then ``on_save``."""
    trainer.state.stateful_callbacks = _export_states(trainer)
    path = trainer.save_checkpoint()
    fire(trainer, "on_save")
    return path


def _export_states(trainer) -> dict:
    """transformers' ``stateful_callbacks`` form: class name -> ``state()`` (a list for several of one class)."""
    from transformers.trainer_callback import ExportableState

    out = {}
    for cb in trainer.callback_handler.callbacks:
        if isinstance(cb, ExportableState):
            name = type(cb).__name__
            if name in out:
                out[name] = (out[name] if isinstance(out[name], list) else [out[name]]) + [cb.state()]
            else:
                out[name] = cb.state()
    return out


def _restore_states(trainer) -> None:
    """Set the saved attributes (``state()["attributes"]``) of each exportable callback of a saved class on the
    trainer's callbacks of that class, in order (a resumed run's callbacks continue where the checkpoint's were)."""
    from transformers.trainer_callback import ExportableState

    saved = getattr(trainer.state, "stateful_callbacks", None) or {}
    for name, data in saved.items():
        mine = [cb for cb in trainer.callback_handler.callbacks
                if isinstance(cb, ExportableState) and type(cb).__name__ == name]
        for cb, entry in zip(mine, data if isinstance(data, list) else [data]):
            for attribute, value in (entry or {}).get("attributes", {}).items():
                setattr(cb, attribute, value)
