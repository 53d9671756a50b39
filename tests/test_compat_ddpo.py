"""TRL DDPO users' reward and prompt functions run unchanged through trl_flow.compat.ddpo."""

from __future__ import annotations

import random

import pytest
import torch

from trl_flow.compat import from_ddpo_reward, prompts_from_ddpo_prompt_fn

ANIMALS = {"cat": 0.25, "dog": 0.5, "owl": 0.75}


def ddpo_prompt_fn():
    """DDPO-style: (prompt, metadata)."""
    animal = random.choice(sorted(ANIMALS))
    return f"a photo of a {animal}", {"animal": animal, "target": ANIMALS[animal]}


def ddpo_reward_fn(images, prompts, prompt_metadata):
    """DDPO-style: minus the distance of the mean pixel to the prompt's target brightness; (rewards, metadata)."""
    assert isinstance(prompts, tuple) and isinstance(prompt_metadata, tuple)
    target = torch.tensor([m["target"] for m in prompt_metadata])
    rewards = -(images.mean(dim=(1, 2, 3)) - target).abs()
    return rewards, {"targets": target}


def test_the_adapter_passes_metadata_and_returns_floats():
    random.seed(0)
    ds = prompts_from_ddpo_prompt_fn(ddpo_prompt_fn, num_prompts=6)
    assert ds.column_names == ["prompt", "prompt_metadata"] and len(ds) == 6
    reward = from_ddpo_reward(ddpo_reward_fn)
    assert reward.__name__ == "ddpo_reward_fn"
    images = torch.full((3, 3, 8, 8), 0.5)
    rows = ds[:3]
    out = reward(images, rows["prompt"], prompt_metadata=rows["prompt_metadata"])
    expected = [-abs(0.5 - ANIMALS[p.split()[-1]]) for p in rows["prompt"]]
    assert out == pytest.approx(expected) and all(isinstance(v, float) for v in out)
    # Without a prompt_metadata column, the other columns form each sample's metadata dict.
    out = reward(images[:2], ["a cat", "a owl"], target=[0.25, 0.75], animal=["cat", "owl"])
    assert out == pytest.approx([-0.25, -0.25])
    assert from_ddpo_reward(ddpo_reward_fn, name="aesthetic").__name__ == "aesthetic"


def test_bad_ddpo_functions_fail_clearly():
    with pytest.raises(TypeError, match="returns \\(rewards, reward_metadata\\)"):
        from_ddpo_reward(lambda images, prompts, metadata: [1.0] * len(prompts))(torch.zeros(1, 3, 4, 4), ["a"])
    with pytest.raises(TypeError, match="a DDPO prompt_fn returns \\(prompt, metadata\\)"):
        prompts_from_ddpo_prompt_fn(lambda: "a cat", num_prompts=2)
    with pytest.raises(ValueError, match="num_prompts"):
        prompts_from_ddpo_prompt_fn(ddpo_prompt_fn, num_prompts=0)


def test_a_ddpo_setup_trains(make_trainer):
    random.seed(1)
    trainer = make_trainer(rewards=[from_ddpo_reward(ddpo_reward_fn)], max_steps=1,
                           train_dataset=prompts_from_ddpo_prompt_fn(ddpo_prompt_fn, num_prompts=8))
    trainer.train()
    ro = trainer.last_rollout
    targets = torch.tensor([ANIMALS[p.split()[-1]] for p in ro.prompts])
    expected = -(ro.images.mean(dim=(1, 2, 3)) - targets).abs()
    assert torch.allclose(ro.rewards, expected, atol=1e-6)
    assert trainer.reward_names == ["ddpo_reward_fn"] and "rewards/ddpo_reward_fn" in trainer.state.log_history[-1]
