"""What a TRL user types, accepted beside trl_flow's own forms.

* The trainer's call: TRL's ``GRPOTrainer(model, reward_funcs, args=config, train_dataset=..., peft_config=...)``
  beside ours, ``FlowGRPOTrainer(config, pipe, reward_funcs, train_dataset=...)`` (:func:`resolve_init_args`).
  ``peft_config`` (a ``peft.LoraConfig``) sets ``lora_r``, ``lora_alpha`` and ``lora_target_modules``.
* TRL's ``GRPOConfig`` names with the same meaning here (:data:`CONFIG_ALIASES`: ``epsilon`` -> ``clip_range``,
  ``num_iterations`` -> ``num_inner_epochs``) set our field, in Python (``FlowGRPOConfig(num_iterations=2)``, through
  :class:`AcceptsTrlNames`, the configs' metaclass), in a recipe and on the command line (``trl_flow/cli.py``).
  TRL names without an equivalent here (:data:`CONFIG_REFUSED`) are refused with a message naming our field.
* The sampling settings a model was trained with travel with it (:func:`model_defaults`): a pipeline's
  ``trl_flow_defaults`` attribute or a ``trl_flow_defaults.json`` in its folder (docs/adding_a_model.md). Where the
  config leaves such a field at its dataclass default the trainer uses the model's value and says so; where the
  config sets another value it warns, naming both (:func:`apply_model_defaults`), before any compute.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings

#: TRL ``GRPOConfig`` name -> trl_flow field of the same meaning.
CONFIG_ALIASES = {
    "epsilon": "clip_range",
    "num_iterations": "num_inner_epochs",
}

#: TRL ``GRPOConfig`` / ``TrainingArguments`` names whose meaning trl_flow has not: (our nearest field, why).
CONFIG_REFUSED = {
    "epsilon_high": ("clip_range", "trl_flow clips the ratio symmetrically, to [1 - clip_range, 1 + clip_range]"),
    "delta": ("clip_range", "trl_flow has no upper bound on the ratio besides the clip of clip_range"),
    "num_train_epochs": ("max_steps", "trl_flow counts iterations (each samples prompts_per_step * num_generations "
                                      "trajectories), not passes over the dataset"),
    "log_completions": ("log_images_steps", "sampled images are logged every log_images_steps iterations"),
    "temperature": ("noise_level", "the rollout's randomness is the transition kernel's noise"),
    "max_completion_length": ("num_inference_steps", "an image has no completion length; sampling has "
                                                     "num_inference_steps steps"),
}

#: Fields that only a method training on the rollout kernel's log-prob ratio reads.
_RATIO_FIELDS = {"clip_range": "there is no log-prob ratio to clip"}

#: The pipeline attribute, or the file in the pipeline's folder, holding the sampling settings its model was
#: trained with (docs/adding_a_model.md).
MODEL_DEFAULTS_ATTR = "trl_flow_defaults"
MODEL_DEFAULTS_FILE = "trl_flow_defaults.json"
#: The config fields a model may carry.
MODEL_DEFAULT_FIELDS = ("max_sequence_length", "guidance_scale", "height", "width", "num_inference_steps",
                        "eval_num_inference_steps")


# ------------------------------------------------------------------------------------------- config names
def _field_names(config_cls) -> set[str]:
    return {f.name for f in dataclasses.fields(config_cls)} if dataclasses.is_dataclass(config_cls) else set()


def alias_target(config_cls, name: str) -> str | None:
    """The field of ``config_cls`` that TRL's ``name`` sets; None when ``name`` is not a TRL name (or is one of
    ``config_cls``'s own fields). Raises ``ValueError`` naming our field when TRL's name has no use here."""
    if name in _field_names(config_cls):
        return None
    cls_name = config_cls.__name__
    if name in CONFIG_REFUSED:
        target, why = CONFIG_REFUSED[name]
        raise ValueError(f"{cls_name}: `{name}` is TRL's GRPOConfig option, with no equivalent here: {why}; "
                         f"see `{target}`")
    target = CONFIG_ALIASES.get(name)
    if target is None:
        return None
    if target not in _field_names(config_cls):
        why = (f": {_RATIO_FIELDS[target]} (its update is not a policy-gradient ratio)" if target in _RATIO_FIELDS
               else "")
        raise ValueError(f"{cls_name}: `{name}` is TRL's name for `{target}`, which {cls_name} does not have{why}; "
                         "remove it")
    return target


def translate_config_kwargs(config_cls, kwargs: dict) -> dict:
    """``kwargs`` of a config's construction with TRL's names replaced by ours (:func:`alias_target`)."""
    out = dict(kwargs)
    for name in list(out):
        target = alias_target(config_cls, name)
        if target is None:
            continue
        value = out.pop(name)
        if target in out and out[target] != value:
            raise ValueError(f"{config_cls.__name__}: {name}={value!r} (TRL's name for {target}) and "
                             f"{target}={out[target]!r} both given; pass only {target}")
        out[target] = value
    if isinstance(out.get("scale_rewards"), bool) and "scale_rewards" in _field_names(config_cls):
        out["scale_rewards"] = "group" if out["scale_rewards"] else "none"  # TRL's True / False
    return out


class AcceptsTrlNames(type):
    """Metaclass of the trainer configs: ``FlowGRPOConfig(num_iterations=2)`` builds ``num_inner_epochs=2``
    (:func:`translate_config_kwargs`). The class stays a plain dataclass (``dataclasses.fields``, ``replace``,
    pickling, ``TrlParser`` are unchanged)."""

    def __call__(cls, *args, **kwargs):
        return super().__call__(*args, **translate_config_kwargs(cls, kwargs))


# ------------------------------------------------------------------------------------------ trainer call
#: TRL trainer keywords that trl_flow has no use for: why, and what to do instead.
_TRL_ONLY_KWARGS = {
    "processing_class": "the pipeline carries its own tokenizers; remove it",
    "reward_processing_classes": "a reward here is a callable reward(images, prompts, **columns) that prepares its "
                                 "own inputs; remove it",
    "optimizers": "the optimizer and schedule are built from the config (optim, learning_rate, lr_scheduler_type, "
                  "warmup_steps); remove it",
}


def resolve_init_args(trainer, config, pipe, reward_funcs, *, model=None, args=None, peft_config=None,
                      kwargs=None):
    """``(config, pipe, reward_funcs)`` of a trainer's call in either form:

    * ours: ``Trainer(config, pipe, reward_funcs, train_dataset=...)``;
    * TRL's: ``Trainer(model=pipe, reward_funcs=..., args=config, train_dataset=..., peft_config=...)``, or
      positionally ``Trainer(pipe, reward_funcs, config, train_dataset)`` (``train_dataset`` and ``eval_dataset``
      are the 4th and 5th in both).

    Without a config, the trainer's ``config_class()`` (as TRL makes a default ``GRPOConfig``). Then
    ``peft_config`` and the model's own sampling settings (:func:`apply_model_defaults`) are applied to a copy of
    the config. Raises naming the argument before any compute."""
    def is_config(obj):  # an instance of a trainer config (FlowRLConfig and its subclasses: this metaclass)
        return isinstance(type(obj), AcceptsTrlNames)

    cls_name = type(trainer).__name__
    for name in kwargs or {}:
        if name in _TRL_ONLY_KWARGS:
            raise TypeError(f"{cls_name}: {name}: {_TRL_ONLY_KWARGS[name]}")
    if kwargs:
        raise TypeError(f"{cls_name}() got unexpected keyword argument(s) {sorted(kwargs)}; it takes config (or "
                        "TRL's args), pipe (or TRL's model), reward_funcs, train_dataset, eval_dataset, peft_config")
    if config is not None and not is_config(config):  # TRL's order: (model, reward_funcs, args)
        if model is not None:
            raise TypeError(f"{cls_name}: the first argument is a {type(config).__name__}, not a config, and model= "
                            "is given too; pass the pipeline once")
        if reward_funcs is not None:
            if not is_config(reward_funcs):
                raise TypeError(f"{cls_name}: the third positional argument is a {type(reward_funcs).__name__}; in "
                                "TRL's order (model, reward_funcs, args) it is the config")
            if args is not None:
                raise TypeError(f"{cls_name}: the config is given twice (third positional argument and args=)")
            args = reward_funcs
        model, reward_funcs, config, pipe = config, pipe, None, None
    if config is not None and args is not None:
        raise TypeError(f"{cls_name}: the config is given twice, as config and as args= (TRL's name); pass it once")
    config = config if config is not None else args
    if config is None:
        config = trainer.config_class()
    if not isinstance(config, trainer.config_class):
        raise TypeError(f"config: expected a {trainer.config_class.__name__}, got {type(config).__name__}")
    if pipe is not None and model is not None:
        raise TypeError(f"{cls_name}: the pipeline is given twice, as pipe and as model= (TRL's name); pass it once")
    pipe = pipe if pipe is not None else model
    if pipe is None:
        raise TypeError(f"{cls_name}: no pipeline; pass model=pipe (TRL's name) or the pipeline as the second "
                        "argument, e.g. StableDiffusion3Pipeline.from_pretrained(...)")
    # ---- a model id or folder in place of a pipeline: loaded with model_init_kwargs (or a clear error), before any
    # compute; the model's own sampling settings below are read from the loaded pipeline
    from ..models.loading import load_model

    pipe = load_model(pipe, config)
    if reward_funcs is None:
        raise TypeError(f"{cls_name}: reward_funcs: required; a callable reward(images, prompts, **columns) or a "
                        "list of them")
    config = apply_peft_config(config, peft_config)
    config = apply_model_defaults(config, pipe)
    return config, pipe, reward_funcs


def _default(config, name):
    f = next(f for f in dataclasses.fields(config) if f.name == name)
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def apply_peft_config(config, peft_config):
    """``config`` with the LoRA of a ``peft.LoraConfig`` (r, lora_alpha, target_modules); a field set in the config
    to another value than both its default and the LoraConfig's is a conflict. Options trl_flow does not train with
    (dropout > 0, DoRA, rsLoRA, bias, modules_to_save, patterns, ...) are refused, naming them."""
    if peft_config is None:
        return config
    from peft import LoraConfig

    if not isinstance(peft_config, LoraConfig):
        raise TypeError(f"peft_config: expected a peft.LoraConfig (trl_flow trains LoRA adapters), got "
                        f"{type(peft_config).__name__}")
    if config.finetune != "lora":
        raise ValueError(f"peft_config: given with finetune={config.finetune!r}; a LoRA needs finetune='lora' (or "
                         "leave peft_config out to train all weights)")
    if peft_config.lora_dropout:
        raise ValueError(f"peft_config.lora_dropout={peft_config.lora_dropout}: must be 0 (LoraConfig(..., "
                         "lora_dropout=0.0)): with dropout the update's first ratio pi_theta / pi_old is not 1 (the "
                         "rollout was sampled without it)")
    unsupported = {"bias": "none", "use_dora": False, "use_rslora": False, "modules_to_save": None,
                   "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {}, "init_lora_weights": True}
    bad = [f"{k}={getattr(peft_config, k)!r}" for k, ok in unsupported.items()
           if (getattr(peft_config, k, ok) or None) != (ok or None)]
    if bad:
        raise ValueError(f"peft_config: {', '.join(bad)} not supported; trl_flow sets r, lora_alpha and "
                         "target_modules from a LoraConfig and trains plain LoRA (leave the others at peft's "
                         "defaults)")
    targets = peft_config.target_modules
    if isinstance(targets, str):
        raise ValueError(f"peft_config.target_modules={targets!r}: give a list of module names (a regular expression "
                         "or 'all-linear' is not supported here); None keeps the model family's defaults "
                         "(docs/models.md)")
    values = {"lora_r": peft_config.r, "lora_alpha": peft_config.lora_alpha,
              "lora_target_modules": sorted(targets) if targets is not None else config.lora_target_modules}
    peft_names = {"lora_r": "r", "lora_alpha": "lora_alpha", "lora_target_modules": "target_modules"}
    for name, value in values.items():
        current = getattr(config, name)
        if current != value and current != _default(config, name):
            raise ValueError(f"peft_config.{peft_names[name]}={value!r} and the config's {name}={current!r} differ; "
                             "set it in one place")
    return dataclasses.replace(config, **values)


# ----------------------------------------------------------------------------------------- model defaults
def model_defaults(pipe) -> tuple[dict, str | None]:
    """``(settings, where)``: the sampling settings the pipeline's model was trained with, from its
    ``trl_flow_defaults`` attribute or a ``trl_flow_defaults.json`` in the folder it was loaded from (``{}``, None
    when it declares none). Unknown keys are an error naming the source."""
    pipe = getattr(pipe, "pipe", pipe)  # an adapter: its pipeline
    found, where = getattr(pipe, MODEL_DEFAULTS_ATTR, None), f"{type(pipe).__name__}.{MODEL_DEFAULTS_ATTR}"
    if found is None:
        folder = getattr(getattr(pipe, "config", None), "_name_or_path", None)
        path = os.path.join(folder, MODEL_DEFAULTS_FILE) if isinstance(folder, str) and folder else None
        if path is None or not os.path.isfile(path):
            return {}, None
        with open(path, encoding="utf-8") as f:
            found, where = json.load(f), path
    if not isinstance(found, dict):
        raise ValueError(f"{where}: expected a mapping of config fields to values, got {type(found).__name__}")
    unknown = sorted(set(found) - set(MODEL_DEFAULT_FIELDS))
    if unknown:
        raise ValueError(f"{where}: unknown settings {unknown}; a model may carry {list(MODEL_DEFAULT_FIELDS)}")
    return dict(found), where


def apply_model_defaults(config, pipe, say=None):
    """``config`` with the model's settings (:func:`model_defaults`) where it leaves a field at its dataclass default;
    a field set to another value is kept, with a warning naming both values. ``say`` (default: print on the main
    process) gets the one line listing what was applied."""
    found, where = model_defaults(pipe)
    if not found:
        return config
    applied, differ = {}, []
    for name, value in found.items():
        current = getattr(config, name)
        if current == value:
            continue
        if current == _default(config, name):
            applied[name] = value
        else:
            differ.append(f"{name}={current!r} (the model's: {value!r})")
    if differ:
        warnings.warn(f"the config sets {', '.join(differ)}, not the settings the model was trained with ({where}); "
                      "samples may be degraded", UserWarning, stacklevel=4)
    if not applied:
        return config
    line = (f"trl_flow: using the model's own sampling settings {', '.join(f'{k}={v!r}' for k, v in applied.items())} "
            f"({where}) for the config fields left at their defaults; set them in the config to override")
    if say is None:
        if int(os.environ.get("RANK", "0") or 0) == 0:
            print(line, flush=True)
    else:
        say(line)
    return dataclasses.replace(config, **applied)
