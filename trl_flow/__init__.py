"""trl_flow: reinforcement-learning post-training for flow-matching diffusers pipelines.

prompts (data.py) -> rollout (rollout.py, kernels.py, models/) -> rewards (rewards/) -> advantages
(advantages.py) -> loss (losses.py) -> update (trainers/).
"""

from .kernels import gaussian_kl, sde_step
from .rewards import jpeg_compressibility, jpeg_incompressibility
from .replay_buffer import ReplayBuffer, ReplayEntry
from .trainers import (
    DiffusionNFTConfig,
    DiffusionNFTTrainer,
    FlowDPPOConfig,
    FlowDPPOTrainer,
    FlowGRPOConfig,
    FlowGRPOTrainer,
    FlowRLConfig,
    FlowRLTrainer,
    OPGRPOConfig,
    OPGRPOTrainer,
    StepwiseFlowGRPOConfig,
    StepwiseFlowGRPOTrainer,
)

__version__ = "0.1.0.dev0"

__all__ = [
    "DiffusionNFTConfig",
    "DiffusionNFTTrainer",
    "FlowDPPOConfig",
    "FlowDPPOTrainer",
    "FlowGRPOConfig",
    "FlowGRPOTrainer",
    "FlowRLConfig",
    "FlowRLTrainer",
    "OPGRPOConfig",
    "OPGRPOTrainer",
    "ReplayBuffer",
    "ReplayEntry",
    "StepwiseFlowGRPOConfig",
    "StepwiseFlowGRPOTrainer",
    "gaussian_kl",
    "jpeg_compressibility",
    "jpeg_incompressibility",
    "sde_step",
]
