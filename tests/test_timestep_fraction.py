"""``timestep_fraction`` on every trainer: the policy-gradient trainers train the rollout's trained steps below
int(K x fraction), as flow_grpo's ``train_sd3.py`` trains ``range(num_train_timesteps)`` (yifan123/flow_grpo ac4c86e,
scripts/train_sd3.py lines 345 and 864); DiffusionNFT draws that many training timesteps per sample."""

from __future__ import annotations

import pytest

import trl_flow
from conftest import PROMPTS, brightness, tiny_config


def _run(tmp_path, fresh_pipe, fraction, **overrides):
    config = tiny_config(tmp_path / str(fraction), num_inference_steps=6, timestep_fraction=fraction, max_steps=1,
                         output_dir=str(tmp_path / f"out{fraction}"), **overrides)
    trainer = trl_flow.FlowGRPOTrainer(config, fresh_pipe(), [brightness], train_dataset=list(PROMPTS))
    seen = []
    forward = trainer.forward_step

    def spy(rollout, idx, k, **kwargs):
        seen.append(k)
        return forward(rollout, idx, k, **kwargs)

    trainer.forward_step = spy
    trainer.train()
    return trainer, seen


def test_half_the_schedule_trains_the_first_half_of_the_steps(tmp_path, fresh_pipe):
    full, steps_full = _run(tmp_path, fresh_pipe, 1.0)
    half, steps_half = _run(tmp_path, fresh_pipe, 0.5)
    assert sorted(set(steps_full)) == [0, 1, 2, 3, 4]  # K = 6: every step but the last
    assert sorted(set(steps_half)) == [0, 1, 2]  # k < int(6 * 0.5)
    assert len(steps_half) * 5 == len(steps_full) * 3  # the transformer calls of the update, counted
    log = half.state.log_history[-1]
    assert log["trained_steps"] == 3 and full.state.log_history[-1]["trained_steps"] == 5
    assert log["ratio_first_max_dev"] == 0.0


def test_fraction_checks(tmp_path):
    with pytest.raises(ValueError, match="timestep_fraction=0.1: int.* trains no timestep"):
        trl_flow.FlowGRPOConfig(output_dir=str(tmp_path), num_inference_steps=4, timestep_fraction=0.1)
    with pytest.raises(ValueError, match="timestep_fraction=0.5: with sde_window_size=2"):
        trl_flow.FlowGRPOConfig(output_dir=str(tmp_path), timestep_fraction=0.5, sde_window_size=2)
    with pytest.raises(ValueError, match="OPGRPOConfig.timestep_fraction=0.5"):
        trl_flow.OPGRPOConfig(output_dir=str(tmp_path), timestep_fraction=0.5)
    assert trl_flow.DiffusionNFTConfig(output_dir=str(tmp_path)).timestep_fraction == 0.99  # its reference default
    assert trl_flow.FlowGRPOConfig(output_dir=str(tmp_path)).timestep_fraction == 1.0
