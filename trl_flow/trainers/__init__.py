from .base_config import FlowRLConfig
from .base_trainer import FlowRLTrainer
from .diffusion_nft_config import DiffusionNFTConfig
from .diffusion_nft_trainer import DiffusionNFTTrainer
from .flow_dppo_config import FlowDPPOConfig
from .flow_dppo_trainer import FlowDPPOTrainer
from .flow_grpo_config import FlowGRPOConfig
from .flow_grpo_trainer import FlowGRPOTrainer
from .op_grpo_config import OPGRPOConfig
from .op_grpo_trainer import OPGRPOTrainer
from .stepwise_flow_grpo_config import StepwiseFlowGRPOConfig
from .stepwise_flow_grpo_trainer import StepwiseFlowGRPOTrainer

__all__ = [
    "DiffusionNFTConfig",
    "DiffusionNFTTrainer",
    "FlowRLConfig",
    "FlowRLTrainer",
    "FlowDPPOConfig",
    "FlowDPPOTrainer",
    "FlowGRPOConfig",
    "FlowGRPOTrainer",
    "OPGRPOConfig",
    "OPGRPOTrainer",
    "StepwiseFlowGRPOConfig",
    "StepwiseFlowGRPOTrainer",
]
