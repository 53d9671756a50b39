"""The trainer's model set-up: dtypes and placement, the LoRA (or full weights) on what the adapter trains, the
reference policy, optimizer, LR schedule and EMA.

What is trained is the adapter's: :meth:`~trl_flow.models.FlowAdapter.trainable_module` (``pipe.transformer``, or
a module holding several transformers, e.g. Wan2.2's two experts) and the pipeline components it holds,
:meth:`~trl_flow.models.FlowAdapter.trained_components` (kept in float32 under ``finetune="full"``).
"""

from __future__ import annotations

import copy
import math

import torch

from .. import memory
from . import checkpoints, distributed, guards


def check_no_adapters(trainer) -> None:
    """Refuse a pipeline whose trained transformer(s) already hold a LoRA adapter (before any compute)."""
    for name in trainer.adapter.trained_components():
        guards.check_no_adapter(getattr(trainer.pipe, name), name)


def remove_adapters(trainer) -> None:
    """Undo the trainer's ``add_adapter`` on every trained transformer after a failed set-up."""
    for name in trainer.adapter.trained_components():
        guards.remove_adapter(getattr(trainer.pipe, name))


def setup_model(trainer) -> None:
    cfg, acc = trainer.config, trainer.accelerator
    pipe = trainer.pipe
    trained = trainer.adapter.trained_components()
    trainer.weight_dtype = torch.bfloat16 if cfg.bf16 else torch.float16 if cfg.fp16 else torch.float32
    memory.check_quantized(pipe, cfg, acc.device)
    trainer.offloader = memory.Offloader(pipe, cfg.offload, acc.device)
    trainer.offloader.place()  # = pipe.to(device), except the offloaded modules, which wait on the CPU
    for name, module in pipe.components.items():
        if isinstance(module, torch.nn.Module):
            module.requires_grad_(False)
            module.eval()
            if ((name not in trained or cfg.finetune == "lora") and trainer.weight_dtype != torch.float32
                    and not memory.is_quantized(module)):  # a quantised module keeps its storage dtype
                module.to(dtype=trainer.weight_dtype)
    transformer = trainer.adapter.trainable_module()
    trainer.ref_model = None
    if cfg.finetune == "lora":
        from peft import LoraConfig

        targets = cfg.lora_target_modules or list(trainer.adapter.default_lora_target_modules)
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
            trainer.ref_model = copy.deepcopy(transformer).requires_grad_(False).to(trainer.weight_dtype)
        transformer.requires_grad_(True)
    if cfg.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    trainer.trainable_params = [p for p in transformer.parameters() if p.requires_grad]
    if not trainer.trainable_params:
        raise ValueError("lora_target_modules: no parameter of the transformer is trainable; check the names")
    if cfg.optim == "adamw_8bit":
        import bitsandbytes as bnb

        opt_cls = bnb.optim.AdamW8bit
    else:
        opt_cls = torch.optim.AdamW
    optimizer = opt_cls(trainer.trainable_params, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                        eps=cfg.adam_epsilon, weight_decay=cfg.weight_decay)
    from transformers import get_scheduler

    n_local = cfg.train_batch_size // acc.num_processes
    n_micro = math.ceil(n_local / cfg.per_device_train_batch_size)
    trainer.optimizer_steps_per_iteration = cfg.num_inner_epochs * math.ceil(n_micro / cfg.gradient_accumulation_steps)
    trainer.lr_scheduler = get_scheduler(
        cfg.lr_scheduler_type, optimizer, num_warmup_steps=cfg.warmup_steps,
        num_training_steps=cfg.max_steps * trainer.optimizer_steps_per_iteration,
    )
    # The LR scheduler is not prepared (accelerate would step it once per process); checkpoints.py saves it.
    hooks = checkpoints.lora_state_hooks(trainer) if cfg.finetune == "lora" else (None, None)
    trainer.model, trainer.optimizer = distributed.prepare(trainer, transformer, optimizer, *hooks)
    trainer.ema = None
    if cfg.ema_decay > 0:
        from diffusers.training_utils import EMAModel

        trainer.ema = EMAModel(trainer.trainable_params, decay=cfg.ema_decay)
        trainer.ema.to(acc.device)
