"""Scoring that overlaps sampling (reward_num_workers): the same images, rewards and weights as scoring after
sampling, really concurrent with the sampler, and failing rewards still stop the iteration before any update."""

from __future__ import annotations

import threading

import pytest
import torch

from conftest import tiny_config
from trl_flow import FlowGRPOConfig, OPGRPOConfig, OPGRPOTrainer


def per_sample(images, prompts, **columns):
    """A per-sample reward that also depends on the prompt and a column."""
    return (images.mean(dim=(1, 2, 3)) * torch.tensor([len(p) for p in prompts])
            + torch.tensor(columns["bonus"], dtype=torch.float32)).tolist()


def half_none(images, prompts, **columns):
    return [None if i % 2 else float(images[i].std()) for i in range(len(prompts))]


DATA = {"prompt": ["a cat", "a red dog", "a blue car", "green sky"], "bonus": [0.0, 0.1, 0.2, 0.3]}


def _lora(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def test_overlapped_scoring_gives_the_sequential_results(make_trainer, tmp_path):
    runs = {}
    for workers in (0, 2):
        trainer = make_trainer(rewards=[per_sample, half_none], train_dataset=DATA, reward_num_workers=workers,
                               per_device_train_batch_size=2, max_steps=1, output_dir=str(tmp_path / f"w{workers}"))
        trainer.train()
        runs[workers] = (trainer.last_rollout, trainer)
    (r0, t0), (r2, t2) = runs[0], runs[2]
    assert "pending_scores" not in r2.extras
    assert torch.equal(r0.states, r2.states) and torch.equal(r0.images, r2.images)
    assert torch.equal(r0.rewards, r2.rewards)
    for name in ("per_sample", "half_none"):
        assert torch.equal(torch.nan_to_num(r0.rewards_per_func[name], nan=-9.0),
                           torch.nan_to_num(r2.rewards_per_func[name], nan=-9.0))
    assert torch.isnan(r2.rewards_per_func["half_none"]).sum() == 4
    assert torch.equal(r0.train_mask, r2.train_mask)
    w0, w2 = _lora(t0), _lora(t2)
    assert all(torch.equal(w0[k], w2[k]) for k in w0)  # the update, bit for bit
    assert [e["reward"] for e in t0.state.log_history] == [e["reward"] for e in t2.state.log_history]
    assert t2.state.log_history[-1]["rewards/half_none_none_frac"] == 0.5
    assert "time/reward_wait_s" in t2.state.log_history[-1]


def test_scoring_runs_in_a_worker_while_the_next_microbatch_is_sampled(make_trainer):
    """Handshake: the sampler, at the first forward pass of the second microbatch, waits for the first
    microbatch's reward to start; that reward then waits for the sampler to go on. Both waits succeed only if
    scoring and sampling run at the same time (sequential scoring times out and fails the test)."""
    steps = 4  # tiny_config: num_inference_steps=4, guidance 1 -> 4 transformer calls per microbatch
    state = {"forwards": 0, "calls": []}
    reward_started, sampler_went_on = threading.Event(), threading.Event()

    def reward(images, prompts, **columns):
        first = not reward_started.is_set()
        reward_started.set()
        overlapped = sampler_went_on.wait(timeout=20) if first else None
        state["calls"].append((threading.current_thread().name, overlapped))
        return [0.0] * len(prompts)

    sampler_went_on.set()  # the constructor's reward check does not wait
    trainer = make_trainer(rewards=[reward], reward_num_workers=1, per_device_train_batch_size=4)
    state["calls"].clear()
    reward_started.clear()
    sampler_went_on.clear()

    def hook(*args):
        state["forwards"] += 1
        if state["forwards"] == steps + 1:  # after the first call of the second microbatch
            state["released"] = reward_started.wait(timeout=20)
            sampler_went_on.set()

    trainer.pipe.transformer.register_forward_hook(hook)
    trainer.make_rollout(0)
    assert state["released"]
    (thread, overlapped), (_, second) = state["calls"]
    assert thread.startswith("trl_flow-reward") and overlapped is True and second is None


def test_a_failing_reward_in_a_worker_stops_before_any_update(make_trainer):
    def flaky(images, prompts, **columns):
        if flaky.calls >= 1:  # the constructor's check passes, the first scored microbatch raises
            raise ValueError("judge offline")
        flaky.calls += 1
        return [1.0] * len(prompts)

    flaky.calls = 0
    trainer = make_trainer(rewards=[flaky], reward_num_workers=2, per_device_train_batch_size=2)
    before = _lora(trainer)
    with pytest.raises(RuntimeError, match="reward function 'flaky' raised ValueError: judge offline"):
        trainer.train()
    after = _lora(trainer)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert trainer.state.global_step == 0


def test_op_grpo_hybrid_rollouts_overlap_identically(tmp_path, fresh_pipe):
    """OP-GRPO concatenates fresh and regenerated-tail parts; both are scored during sampling, in order."""
    out = {}
    for workers in (0, 3):
        cfg = tiny_config(tmp_path / f"w{workers}", OPGRPOConfig, num_generations=2, prompts_per_step=2,
                          off_policy_fraction=0.5, truncation_step=2, per_device_train_batch_size=1, max_steps=3,
                          reward_num_workers=workers, output_dir=str(tmp_path / f"w{workers}"))
        trainer = OPGRPOTrainer(cfg, fresh_pipe(), [per_sample], train_dataset=DATA)
        trainer.train()
        out[workers] = trainer
    h0, h3 = out[0].state.log_history, out[3].state.log_history
    assert h3[-1]["off_policy_share"] > 0  # replayed tails were part of the overlapped rollouts
    assert [e["reward"] for e in h0] == [e["reward"] for e in h3]
    w0, w3 = _lora(out[0]), _lora(out[3])
    assert all(torch.equal(w0[k], w3[k]) for k in w0)


def test_reward_num_workers_is_validated(tmp_path):
    with pytest.raises(ValueError, match="reward_num_workers"):
        FlowGRPOConfig(output_dir=str(tmp_path), reward_num_workers=-1)
