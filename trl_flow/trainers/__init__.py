"""The methods, each a ``<method>_config.py`` / ``<method>_trainer.py`` pair on the shared base, registered by name
(:mod:`.registry`). Everything exported here follows from the registry."""

from .base_config import FlowRLConfig
from .base_trainer import FlowRLTrainer
from .diffusion_nft_trainer import DiffusionNFTTrainer
from .flow_dppo_trainer import FlowDPPOTrainer
from .flow_grpo_trainer import FlowGRPOTrainer
from .op_grpo_trainer import OPGRPOTrainer
from .registry import get_trainer, register_trainer, registered_trainers, trainer_aliases
from .stepwise_flow_grpo_trainer import StepwiseFlowGRPOTrainer

# name (the `trl-flow` subcommand), class, aliases (the method's own name, as checkpoints and benchmarks spell it)
register_trainer("grpo", FlowGRPOTrainer, aliases=("flow_grpo",))
register_trainer("op-grpo", OPGRPOTrainer, aliases=("op_grpo",))
register_trainer("stepwise", StepwiseFlowGRPOTrainer, aliases=("stepwise_flow_grpo",))
register_trainer("dppo", FlowDPPOTrainer, aliases=("flow_dppo",))
register_trainer("nft", DiffusionNFTTrainer, aliases=("diffusion_nft",))


def _exports() -> dict[str, type]:
    """The built-in trainers and their configs by class name (entry points load later, on first use)."""
    from . import registry

    out = {"FlowRLConfig": FlowRLConfig, "FlowRLTrainer": FlowRLTrainer}
    for cls in registry._TRAINERS.values():
        out[cls.__name__] = cls
        out[cls.config_class.__name__] = cls.config_class
    return out


globals().update(_exports())
__all__ = sorted(_exports()) + ["get_trainer", "register_trainer", "registered_trainers", "trainer_aliases"]
