"""``batch_replay_steps``: a microbatch's loss terms (the trained steps; DiffusionNFT's training points) re-scored in
one transformer forward of B*S rows, as UniRL's batched replay does (Tencent-Hunyuan/UniRL commit 0c97cfb8f458,
unirl/models/types/batched_replay.py:26, ``BatchedStepReplayMixin._replay_batched_steps``, gated by its
``batch_replay_steps`` flag; PRs #144, #156, #394). Against the per-step path after one iteration: the same
gradients and LoRA weights to float rounding (not bit for bit: one backward of the sum instead of S), the same
logged statistics, the first ratio's deviation exactly 0 on the tiny pipeline (its forward at B*S rows is bit-equal
to B rows), and one update transformer call per microbatch instead of S."""

from __future__ import annotations

import pytest
import torch

import trl_flow
from conftest import PROMPTS, brightness, tiny_config
from trl_flow.testing import tiny_sd3_pipeline

CASES = {  # name: (trainer, config overrides); every method and the options that touch the forward or the loss
    "flow_grpo_cfg_beta_cond_only": (trl_flow.FlowGRPOTrainer, dict(beta=0.04, guidance_scale=4.5)),
    "flow_grpo_both_exact_fraction": (trl_flow.FlowGRPOTrainer, dict(
        beta=0.01, kl_form="exact", guidance_scale=4.5, guidance_grad="both", num_inference_steps=6,
        timestep_fraction=0.5, logprob_reduction="sum")),
    "flow_dppo_kl_mask": (trl_flow.FlowDPPOTrainer, dict(beta=0.01)),
    "stepwise": (trl_flow.StepwiseFlowGRPOTrainer, {}),
    "op_grpo": (trl_flow.OPGRPOTrainer, dict(max_steps=2, off_policy_fraction=0.5, truncation_step=2)),
    "diffusion_nft_cfg_beta": (trl_flow.DiffusionNFTTrainer, dict(beta=0.01, guidance_scale=4.5)),
}


def _run(tmp_path, trainer_class, batched, **overrides):
    """One iteration; its two microbatches make one optimizer step, so every logged statistic is taken at the same
    weights both ways."""
    config_class = getattr(trl_flow, trainer_class.__name__.replace("Trainer", "Config"))
    overrides = {"max_steps": 1, "gradient_accumulation_steps": 2, **overrides}
    config = tiny_config(tmp_path / str(batched), config_class, **overrides, batch_replay_steps=batched)
    torch.manual_seed(0)
    trainer = trainer_class(config, tiny_sd3_pipeline(), [brightness], train_dataset=list(PROMPTS))
    grads, step = [], trainer._optimizer_step

    def spy():
        grads.append({n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None})
        return step()

    trainer._optimizer_step = spy
    trainer.train()
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    return trainer, grads, weights


@pytest.mark.parametrize("case", list(CASES))
def test_batched_replay_matches_the_per_step_update_with_one_call_per_microbatch(tmp_path, case):
    trainer_class, overrides = CASES[case]
    seq, g_seq, w_seq = _run(tmp_path, trainer_class, False, **overrides)
    bat, g_bat, w_bat = _run(tmp_path, trainer_class, True, **overrides)
    assert len(g_seq) == len(g_bat) > 0
    for a, b in zip(g_seq, g_bat):
        assert a.keys() == b.keys()
        scale = max(float(g.abs().max()) for g in a.values())
        for n in a:  # measured: <= 1.5e-5 x max |g| (one backward of the sum vs S backwards)
            assert float((a[n] - b[n]).abs().max()) <= 1e-4 * scale, n
    lr = seq.config.learning_rate
    for n in w_seq:  # Adam's per-element m / sqrt(v) magnifies rounding of tiny gradients: measured <= 0.03 lr
        assert float((w_seq[n] - w_bat[n]).abs().max()) <= 0.1 * lr, n
    for i, (log_s, log_b) in enumerate(zip(seq.state.log_history, bat.state.log_history)):
        terms = log_s["trained_steps"]
        assert log_b["trained_steps"] == terms > 1
        calls_s, calls_b = log_s["calls/update_transformer"], log_b["calls/update_transformer"]
        assert calls_s == terms * calls_b  # (microbatches x S) -> microbatches (x policies: reference, old)
        assert set(log_s) == set(log_b)
        if i:
            continue  # OP-GRPO's second iteration starts from weights that differ by rounding
        for key in ("loss", "clip_frac", "mask_frac", "kl", "kl_old", "ratio", "ratio_max", "ratio_min",
                    "policy_loss", "nft/r_mean", "clip_frac_off_policy", "off_policy_share"):
            if key in log_s:
                assert log_b[key] == pytest.approx(log_s[key], rel=1e-4, abs=1e-7), key  # loss: mean(-A rho) ~ 0
        if "ratio_first_max_dev" in log_s:  # measured exactly 0 both ways on the tiny pipeline
            assert log_s["ratio_first_max_dev"] == log_b["ratio_first_max_dev"] == 0.0
    if trainer_class is trl_flow.OPGRPOTrainer:
        assert any(e["off_policy_share"] > 0 for e in bat.state.log_history)  # replayed tails were trained


def test_forward_steps_equals_forward_step_per_step(tmp_path):
    """The batched re-scoring itself, at the rollout's weights, with CFG and the reference: log-probs and means of
    every step as the per-step forward gives them, and as the rollout stored them."""
    config = tiny_config(tmp_path, max_steps=1, beta=0.04, guidance_scale=4.5, batch_replay_steps=True)
    trainer = trl_flow.FlowGRPOTrainer(config, tiny_sd3_pipeline(), [brightness],
                                       train_dataset=list(PROMPTS))
    rollout = trainer.make_rollout(0)
    idx, ks = torch.arange(4), rollout.trained_steps()
    with torch.no_grad():
        batched = trainer.forward_steps(rollout, idx, ks, need_ref=True)
        single = [trainer.forward_step(rollout, idx, k, need_ref=True) for k in ks]
    for k, b, s in zip(ks, batched, single):
        for name in ("log_prob", "mean", "std", "ref_mean"):
            torch.testing.assert_close(getattr(b, name), getattr(s, name), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(b.log_prob, rollout.log_probs[idx, k], rtol=1e-6, atol=1e-7)


def test_a_trainer_that_cannot_batch_its_terms_refuses_the_field(tmp_path):
    def build(cls, config_class=trl_flow.FlowGRPOConfig):
        config = tiny_config(tmp_path, config_class, batch_replay_steps=True)
        return cls(config, tiny_sd3_pipeline(), [brightness], train_dataset=list(PROMPTS))

    class OwnTermLoss(trl_flow.FlowGRPOTrainer):
        def term_loss(self, rollout, idx, k):
            return super().term_loss(rollout, idx, k)

    class OwnForward(trl_flow.FlowGRPOTrainer):
        def forward_step(self, rollout, idx, k, need_ref):
            return super().forward_step(rollout, idx, k, need_ref)

    class OwnPoint(trl_flow.DiffusionNFTTrainer):
        def nft_point(self, rollout, idx, k_idx, gens, r):
            return super().nft_point(rollout, idx, k_idx, gens, r)

    class BatchesItsOwn(OwnTermLoss):
        def term_losses(self, rollout, idx, ks):
            return [self.term_loss(rollout, idx, k) for k in ks]

    from trl_flow.trainers.base_trainer import FlowRLTrainer

    class Plain(FlowRLTrainer):
        pass

    for cls, config_class, hook in ((OwnTermLoss, trl_flow.FlowGRPOConfig, "term_loss"),
                                    (OwnForward, trl_flow.FlowGRPOConfig, "forward_step"),
                                    (OwnPoint, trl_flow.DiffusionNFTConfig, "nft_point")):
        with pytest.raises(ValueError, match=f"batch_replay_steps=True: {cls.__name__} overrides {hook}.*"
                                             "set batch_replay_steps=False"):
            build(cls, config_class)
    with pytest.raises(ValueError, match="batch_replay_steps=True: Plain computes its loss terms one by one"):
        build(Plain, trl_flow.FlowGRPOConfig)
    assert build(BatchesItsOwn).config.batch_replay_steps  # its own term_losses: accepted
