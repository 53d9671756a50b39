"""Adapters for code written for other libraries (TRL's removed DDPOTrainer)."""

from .ddpo import from_ddpo_reward, prompts_from_ddpo_prompt_fn

__all__ = ["from_ddpo_reward", "prompts_from_ddpo_prompt_fn"]
