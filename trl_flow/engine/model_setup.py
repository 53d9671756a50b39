"""The trainer's model set-up: dtypes and placement, the LoRA (or full weights) on what the adapter trains, the
reference policy, optimizer, LR schedule and EMA.

What is trained is the adapter's: :meth:`~trl_flow.models.FlowAdapter.trainable_module` (``pipe.transformer``, or
a module holding several transformers, e.g. Wan2.2's two experts) and the pipeline components it holds,
:meth:`~trl_flow.models.FlowAdapter.trained_components` (kept in float32 under ``finetune="full"``).
"""

from __future__ import annotations

import copy
import dataclasses
import math

import torch

from .. import memory
from . import compute_options, distributed, guards


def check_no_adapters(trainer) -> None:
    """Refuse a pipeline whose trained transformer(s) already hold a LoRA adapter (before any compute)."""
    for name in trainer.adapter.trained_components():
        guards.check_no_adapter(getattr(trainer.pipe, name), name)


def remove_adapters(trainer) -> None:
    """Undo the trainer's ``add_adapter`` on every trained transformer after a failed set-up."""
    for name in trainer.adapter.trained_components():
        guards.remove_adapter(getattr(trainer.pipe, name))


@dataclasses.dataclass
class ModelState:
    """What model set-up builds and the trainer holds: the prepared trained model, its optimizer, LR schedule and
    EMA, the reference policy's frozen copy (full fine-tuning with ``beta > 0``), the trained parameters, the dtype
    of the frozen weights, the offloader and the optimizer steps of one iteration."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    lr_scheduler: object
    ema: object | None
    ref_model: torch.nn.Module | None
    trainable_params: list
    weight_dtype: torch.dtype
    offloader: memory.Offloader
    optimizer_steps_per_iteration: int


def setup_model(cfg, acc, adapter, hooks=(None, None)) -> ModelState:
    """Dtypes and placement of ``adapter.pipe``, the LoRA (or full weights) on what the adapter trains, the reference
    copy, optimizer, LR schedule and EMA. ``hooks``: accelerate's save-state / load-state pre-hooks (a LoRA run's:
    :func:`~trl_flow.engine.checkpoints.lora_state_hooks`)."""
    pipe = adapter.pipe
    trained = adapter.trained_components()
    weight_dtype = torch.bfloat16 if cfg.bf16 else torch.float16 if cfg.fp16 else torch.float32
    memory.check_quantized(pipe, cfg, acc.device)
    offloader = memory.Offloader(pipe, cfg.offload, acc.device)
    offloader.place()  # = pipe.to(device), except the offloaded modules, which wait on the CPU
    for name, module in pipe.components.items():
        if isinstance(module, torch.nn.Module):
            module.requires_grad_(False)
            module.eval()
            if ((name not in trained or cfg.finetune == "lora") and weight_dtype != torch.float32
                    and not memory.is_quantized(module)):  # a quantised module keeps its storage dtype
                module.to(dtype=weight_dtype)
    compute_options.set_attention_backend(adapter, getattr(cfg, "attention_backend", None), acc.device)
    transformer = adapter.trainable_module()
    ref_model = None
    if cfg.finetune == "lora":
        from peft import LoraConfig

        targets = cfg.lora_target_modules or list(adapter.default_lora_target_modules)
        with torch.random.fork_rng(devices=[]):  # the LoRA init is a function of config.seed alone
            torch.manual_seed(cfg.seed)
            transformer.add_adapter(
                LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                           init_lora_weights=True, target_modules=targets)
            )
        from diffusers.training_utils import cast_training_params

        cast_training_params(transformer, dtype=torch.float32)  # trainable LoRA weights stay float32
    else:
        if cfg.beta > 0:
            ref_model = copy.deepcopy(transformer).requires_grad_(False).to(weight_dtype)
        transformer.requires_grad_(True)
    if cfg.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    if getattr(cfg, "compile_repeated_blocks", False):  # after the LoRA: the compiled blocks hold it
        compute_options.compile_repeated_blocks(adapter)
    trainable_params = [p for p in transformer.parameters() if p.requires_grad]
    if not trainable_params:
        raise ValueError("lora_target_modules: no parameter of the transformer is trainable; check the names")
    if cfg.optim == "adamw_8bit":
        import bitsandbytes as bnb

        opt_cls = bnb.optim.AdamW8bit
    else:
        opt_cls = torch.optim.AdamW
    optimizer = opt_cls(trainable_params, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                        eps=cfg.adam_epsilon, weight_decay=cfg.weight_decay)
    from transformers import get_scheduler

    n_local = cfg.train_batch_size // acc.num_processes
    n_micro = math.ceil(n_local / cfg.per_device_train_batch_size)
    steps_per_iteration = cfg.num_inner_epochs * math.ceil(n_micro / cfg.gradient_accumulation_steps)
    lr_scheduler = get_scheduler(
        cfg.lr_scheduler_type, optimizer, num_warmup_steps=cfg.warmup_steps,
        num_training_steps=cfg.max_steps * steps_per_iteration,
    )
    # The LR scheduler is not prepared (accelerate would step it once per process); checkpoints.py saves it.
    model, optimizer, trainable_params, ref_model = distributed.prepare(acc, transformer, optimizer, ref_model, *hooks)
    ema = None
    if cfg.ema_decay > 0:
        from diffusers.training_utils import EMAModel

        ema = EMAModel(trainable_params, decay=cfg.ema_decay)
        ema.to(acc.device)
    return ModelState(model=model, optimizer=optimizer, lr_scheduler=lr_scheduler, ema=ema, ref_model=ref_model,
                      trainable_params=trainable_params, weight_dtype=weight_dtype, offloader=offloader,
                      optimizer_steps_per_iteration=steps_per_iteration)
