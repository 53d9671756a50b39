"""``trajectory_storage="trained"`` and ``offload_rollout_to_cpu``: the rollout keeps only the transitions the update
can train (Flow-Factory's ``trajectory_indices``, X-GenGroup/Flow-Factory src/flow_factory/trainers/rl/grpo.py at
b30dc00) and may keep them in CPU memory (its ``offload_samples_to_cpu``); the update reads the same values, so
metrics and weights are bit for bit those of full storage."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import PROMPTS, brightness, tiny_config

import trl_flow
import trl_flow.testing


def _run(cls, tmp_path, name, **overrides):
    kwargs = dict(num_inference_steps=6, max_steps=2, beta=0.04, learning_rate=3e-3)
    kwargs.update(overrides)
    fields = {f.name for f in dataclasses.fields(cls.config_class)}
    config = tiny_config(tmp_path, cls.config_class, output_dir=str(tmp_path / name),
                         **{k: v for k, v in kwargs.items() if k in fields})
    trainer = cls(config, trl_flow.testing.tiny_sd3_pipeline(), [brightness], train_dataset=list(PROMPTS))
    trainer.train()
    return trainer


def _lora(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora" in n}


CASES = {
    "grpo-window": (trl_flow.FlowGRPOTrainer, dict(sde_window_size=2, sde_window_range=3)),
    "grpo-fraction": (trl_flow.FlowGRPOTrainer, dict(timestep_fraction=0.5)),
    "grpo-window-shared-prefix": (trl_flow.FlowGRPOTrainer, dict(sde_window_size=2, sde_window_range=3,
                                                                 same_noise_per_group=True, shared_prefix=True)),
    "stepwise-window": (trl_flow.StepwiseFlowGRPOTrainer, dict(sde_window_size=2, sde_window_range=3)),
    "dppo-random": (trl_flow.FlowDPPOTrainer, dict(sde_window_size=2, sde_window_range=4, sde_steps_mode="random")),
    # the Flow-GRPO-Fast settings together: batched replay reads the stored steps through Rollout.state too
    "grpo-fast": (trl_flow.FlowGRPOTrainer, dict(sde_window_size=2, sde_window_range=3, same_noise_per_group=True,
                                                 shared_prefix=True, batch_replay_steps=True,
                                                 cache_prompt_embeds=True)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_trained_storage_and_offload_are_bit_identical_and_smaller(tmp_path, case):
    cls, extra = CASES[case]
    full = _run(cls, tmp_path, "full", **extra)
    small = _run(cls, tmp_path, "small", trajectory_storage="trained", offload_rollout_to_cpu=True, **extra)
    for a, b in zip(full.state.log_history, small.state.log_history, strict=True):
        assert {k: v for k, v in a.items() if not k.startswith(("time/", "throughput/", "stepwise/extra_s"))} == {
            k: v for k, v in b.items() if not k.startswith(("time/", "throughput/", "stepwise/extra_s"))}
    wa, wb = _lora(full), _lora(small)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[n], wb[n]) for n in wa)

    r, s = full.last_rollout, small.last_rollout
    K, N = r.schedule.num_steps, len(r)
    lat = r.states[0, 0].numel()
    kept = small.stored_steps(s.extras["step_kinds"])
    assert s.mean_steps == kept and s.state_steps == sorted({j for k in kept for j in (k, k + 1)} | {K})
    assert s.states.device.type == "cpu" and s.means.device.type == "cpu"
    vel = 0 if r.velocities is None else 1  # Stepwise keeps velocities: K of them, or one per stored state below K
    assert r.stored_bytes() == N * (K + 1 + K + vel * K) * lat * 4 + N * K * 4
    S, T = len(s.state_steps), len(kept)  # velocities: at the stored states below K
    assert s.stored_bytes() == N * (S + T + vel * (S - 1)) * lat * 4 + N * K * 4
    for k in kept:  # the stored values are full storage's, read through the accessors
        idx = torch.arange(N)
        assert torch.equal(s.state(idx, k), r.states[:, k]) and torch.equal(s.state(idx, k + 1), r.states[:, k + 1])
        assert torch.equal(s.mean(idx, k), r.means[:, k])
    assert torch.equal(s.states[:, -1], r.states[:, -1])


def test_bytes_of_a_window_of_two_in_ten_steps(tmp_path):
    """K = 10, a window of 2 consecutive steps: 3 states + the final one (4 of 11) and 2 means (of 10)."""
    trainer = _run(trl_flow.FlowGRPOTrainer, tmp_path, "w", num_inference_steps=10, sde_window_size=2,
                   sde_window_range=5, max_steps=1, trajectory_storage="trained")
    r = trainer.last_rollout
    N, lat = len(r), r.states[0, 0].numel()
    assert len(r.state_steps) == 4 and len(r.mean_steps) == 2
    assert r.stored_bytes() == N * 6 * lat * 4 + N * 10 * 4  # full: N 21 lat 4 + N 10 4
    with pytest.raises(KeyError, match=r"Rollout.state: step\(s\) \d+ not stored"):
        r.state(torch.arange(N), next(k for k in range(11) if k not in r.state_steps))


def test_op_grpo_refuses_window_storage_and_offload(tmp_path):
    with pytest.raises(ValueError, match="OPGRPOConfig.trajectory_storage='trained': OP-GRPO offers whole"):
        trl_flow.OPGRPOConfig(output_dir=str(tmp_path), trajectory_storage="trained")
    with pytest.raises(ValueError, match="OPGRPOConfig.offload_rollout_to_cpu=True"):
        trl_flow.OPGRPOConfig(output_dir=str(tmp_path), offload_rollout_to_cpu=True)
    with pytest.raises(ValueError, match="trajectory_storage='window': must be one of"):
        trl_flow.FlowGRPOConfig(output_dir=str(tmp_path), trajectory_storage="window")
