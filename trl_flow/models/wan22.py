"""Wan2.2's two-expert form (Wan2.2-T2V-A14B) for :class:`~trl_flow.models.wan.WanAdapter`.

``WanPipeline`` with ``boundary_ratio`` holds two transformers: ``transformer`` denoises the high-noise steps
(``t >= boundary_ratio * num_train_timesteps``), ``transformer_2`` the low-noise ones, the latter guided with
``guidance_scale_2``. Here:

* :func:`expert_of` routes each sample's timestep to its expert with the pipeline's own comparison (a float32 tensor
  against the Python boundary), so the switch lands on the pipeline's step;
* :class:`WanExperts` is the module the trainer trains: it holds the trained expert(s) (``experts``: ``all``,
  ``high_noise`` or ``low_noise``) as submodules named like the pipeline's components, so a LoRA, an optimizer, a
  frozen reference copy and the checkpoint's parameter names cover exactly the trained experts. An expert that is
  not trained is called from the pipeline directly, frozen: at its steps policy and reference coincide, so those
  steps are sampled with the ODE kernel and never trained (:meth:`WanAdapter.trainable_steps`);
* the LoRA of each trained expert is its own diffusers file (``transformer`` ->
  ``pytorch_lora_weights.safetensors``, ``transformer_2`` -> ``pytorch_lora_weights_transformer_2.safetensors``),
  loaded as diffusers loads Wan2.2 LoRAs: the second with ``load_lora_weights(..., load_into_transformer_2=True)``.
"""

from __future__ import annotations

import copy

import torch

#: ``experts`` values: which transformers of a two-expert pipeline are trained.
EXPERT_CHOICES = {"all": ("transformer", "transformer_2"), "high_noise": ("transformer",),
                  "low_noise": ("transformer_2",)}
#: The LoRA file of each expert in a saved model or checkpoint.
LORA_FILES = {"transformer": "pytorch_lora_weights.safetensors",
              "transformer_2": "pytorch_lora_weights_transformer_2.safetensors"}


def boundary_timestep(pipe):
    """The pipeline's switch timestep (``boundary_ratio * num_train_timesteps``, computed as ``WanPipeline.__call__``
    does), or None for a single-expert pipeline."""
    ratio = pipe.config.get("boundary_ratio")
    if ratio is None:
        return None
    return ratio * pipe.scheduler.config.num_train_timesteps


def expert_of(t: torch.Tensor, boundary) -> torch.Tensor:
    """(B,) bool, True where the high-noise expert (``transformer``) serves timestep ``t`` (B,): ``t >= boundary``
    evaluated like the pipeline's ``t >= boundary_timestep`` (tensor dtype, not Python float)."""
    if boundary is None:
        return torch.ones(t.shape, dtype=torch.bool, device=t.device)
    return t >= boundary


class WanExperts(torch.nn.Module):
    """The trained expert(s) of a two-expert Wan2.2 pipeline, as one module (the same module objects as the
    pipeline's, not copies). ``forward(expert=name, **kwargs)`` calls that expert, so that a DDP wrapper sees the
    call. Adapter methods (``add_adapter``, ``disable_adapters``, ...) apply to every held expert."""

    def __init__(self, experts: dict[str, torch.nn.Module]):
        super().__init__()
        for name, module in experts.items():
            self.add_module(name, module)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.named_children())

    def forward(self, expert: str, **kwargs):
        return getattr(self, expert)(**kwargs)

    # ----- what the trainer calls on a diffusers ModelMixin, applied to each expert
    def add_adapter(self, adapter_config, adapter_name: str = "default") -> None:
        for module in self.children():
            module.add_adapter(copy.deepcopy(adapter_config), adapter_name=adapter_name)

    @property
    def peft_config(self) -> dict:
        return next(self.children()).peft_config

    def disable_adapters(self) -> None:
        for module in self.children():
            module.disable_adapters()

    def enable_adapters(self) -> None:
        for module in self.children():
            module.enable_adapters()

    def enable_gradient_checkpointing(self) -> None:
        for module in self.children():
            module.enable_gradient_checkpointing()

    @property
    def dtype(self) -> torch.dtype:
        return next(self.children()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.children()).device


def split_lora_state_dict(state_dict: dict, names) -> dict[str, dict]:
    """Peft state dict of a :class:`WanExperts` ("transformer.blocks...", "transformer_2.blocks...") -> one state
    dict per expert, names relative to that expert."""
    out = {}
    for name in names:
        prefix = f"{name}."
        out[name] = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
    return out
