"""trl_flow: reinforcement-learning post-training for flow-matching diffusers pipelines.

prompts (data.py) -> rollout (rollout.py, kernels.py, models/) -> rewards (rewards/) -> advantages
(advantages.py) -> loss (losses.py) -> update (trainers/).
"""

from .engine.stored_embeds import precompute_prompt_embeds
from .kernels import gaussian_kl, sde_step
from .rewards import jpeg_compressibility, jpeg_incompressibility
from .replay_buffer import ReplayBuffer, ReplayEntry
from .trainers import *  # noqa: F403  (the registered trainers and their configs)
from .trainers import __all__ as _trainers_all
from .trainers.registry import get_trainer, register_trainer, registered_trainers, trainer_aliases

__version__ = "0.1.0.dev0"

__all__ = sorted([*_trainers_all, "ReplayBuffer", "ReplayEntry", "gaussian_kl", "jpeg_compressibility",
                  "jpeg_incompressibility", "precompute_prompt_embeds", "sde_step"])
