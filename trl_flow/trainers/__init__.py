from .base_config import FlowRLConfig
from .base_trainer import FlowRLTrainer
from .flow_grpo_config import FlowGRPOConfig
from .flow_grpo_trainer import FlowGRPOTrainer
from .op_grpo_config import OPGRPOConfig
from .op_grpo_trainer import OPGRPOTrainer

__all__ = ["FlowRLConfig", "FlowRLTrainer", "FlowGRPOConfig", "FlowGRPOTrainer", "OPGRPOConfig", "OPGRPOTrainer"]
