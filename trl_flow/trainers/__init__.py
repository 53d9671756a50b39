from .base_config import FlowRLConfig
from .base_trainer import FlowRLTrainer
from .flow_grpo_config import FlowGRPOConfig
from .flow_grpo_trainer import FlowGRPOTrainer

__all__ = ["FlowRLConfig", "FlowRLTrainer", "FlowGRPOConfig", "FlowGRPOTrainer"]
