"""FlowGRPOTrainer end to end on the tiny SD3 pipeline (fp32, CPU)."""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch
from conftest import HEIGHT, MAX_SEQ, PROMPTS, WIDTH, brightness, tiny_config

from trl_flow import FlowGRPOConfig, FlowGRPOTrainer
from trl_flow.advantages import group_advantages
from trl_flow.storage import LORA_WEIGHT_NAME

NAN = float("nan")


# ---------------------------------------------------------------------------------------------------- helpers
def all_params(pipe) -> dict[str, torch.Tensor]:
    """A copy of every parameter of every model of the pipeline, keyed component.name."""
    out = {}
    for comp in ("transformer", "vae", "text_encoder", "text_encoder_2"):
        for name, p in getattr(pipe, comp).named_parameters():
            out[f"{comp}.{name}"] = p.detach().clone()
    return out


def lora_params(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.pipe.transformer.named_parameters() if "lora_" in n}


def changed(before: dict, after: dict) -> list[str]:
    assert before.keys() == after.keys()
    return [n for n in before if not torch.equal(before[n], after[n])]


def pipe_latents(pipe, prompts=PROMPTS[:2], seed=0, guidance_scale=4.5, output_type="latent", steps=4):
    return pipe(list(prompts), height=HEIGHT, width=WIDTH, num_inference_steps=steps, guidance_scale=guidance_scale,
                generator=torch.Generator().manual_seed(seed), output_type=output_type,
                max_sequence_length=MAX_SEQ).images


def log_at(trainer, step, key):
    vals = [e[key] for e in trainer.state.log_history if e["step"] == step and key in e]
    assert len(vals) == 1, (step, key, trainer.state.log_history)
    return vals[0]


# ------------------------------------------------------------------------------------------ ratio == 1
@pytest.mark.parametrize("sampler,guidance,reduction", [("flow_sde", 4.5, "mean"), ("cps", 1.0, "sum"),
                                                        ("ddim", 1.0, "mean")])
def test_first_inner_step_ratio_is_exactly_one(make_trainer, sampler, guidance, reduction):
    trainer = make_trainer(sampler=sampler, guidance_scale=guidance, logprob_reduction=reduction, beta=0.04,
                           max_steps=2, learning_rate=3e-3)
    trainer.train()
    for step in (1, 2):
        assert log_at(trainer, step, "ratio_first_max_dev") == 0.0
    assert any(not torch.equal(p, torch.zeros_like(p)) for n, p in lora_params(trainer).items() if "lora_B" in n)
    # directly, with a trained (non-zero) LoRA: re-scoring the rollout reproduces logp_old bit for bit
    rollout = trainer.make_rollout(2)
    mb = trainer.config.per_device_train_batch_size
    trained = [k for k in range(rollout.schedule.num_steps) if bool(rollout.train_mask[:, k].any())]
    expected_trained = {"flow_sde": [0, 1, 2], "cps": [0, 1, 2], "ddim": [1, 2]}[sampler]
    assert trained == expected_trained  # the last step (and ddim's first) is never trained
    for lo in range(0, len(rollout), mb):
        idx = torch.arange(lo, lo + mb)
        for k in trained:
            out = trainer.forward_step(rollout, idx, k, need_ref=False)
            assert out.log_prob.requires_grad
            assert torch.equal(out.log_prob.detach(), rollout.log_probs[idx, k]), (lo, k)
            assert torch.equal(out.mean.detach(), rollout.means[idx, k])


# --------------------------------------------------------------------------------- loss and reference
def test_compute_loss_matches_the_flow_grpo_objective(make_trainer):
    from types import SimpleNamespace

    from trl_flow.trainers.policy_gradient_trainer import StepOutput

    from trl_flow.models import Schedule

    trainer = make_trainer(beta=0.5, clip_range=0.1, kl_form="exact")
    B, K = 4, 3
    old = torch.tensor([[0.0, -1.0, 0.0], [0.0, 0.5, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 0.0]])
    adv = torch.tensor([1.0, -2.0, 0.5, 3.0])
    mask = torch.tensor([[True] * K, [True] * K, [True] * K, [False] * K])  # sample 3 has no reward
    schedule = Schedule(sigmas=torch.tensor([1.0, 0.8, 0.5, 0.0]), timesteps=torch.tensor([1000.0, 800.0, 500.0]))
    means = torch.zeros(B, K, 2, 2)
    rollout = SimpleNamespace(log_probs=old, advantages=adv, train_mask=mask, schedule=schedule, means=means,
                              mean=lambda idx, k: means[idx, k],  # Rollout.mean
                              extras={"step_kinds": ["flow_sde", "flow_sde", "ode"]})
    new_lp = torch.tensor([-0.8, 0.3, 2.05, 7.0], requires_grad=True)
    mean = torch.zeros(B, 2, 2)
    ref_mean = torch.stack([torch.full((2, 2), 0.1 * i) for i in range(B)])
    out = StepOutput(log_prob=new_lp, mean=mean, std=torch.tensor(0.5), ref_mean=ref_mean)
    idx = torch.arange(B)
    loss, stats = trainer.compute_loss(rollout, idx, 1, out)
    expected = []
    for i in range(3):  # by hand, per valid sample
        rho = math.exp(float(new_lp[i]) - float(old[i, 1]))
        a = float(adv[i])
        ppo = max(-a * rho, -a * min(max(rho, 0.9), 1.1))
        kl = (0.1 * i) ** 2 / (2 * 0.25)  # mean over the 4 dims of a constant difference
        expected.append(ppo + 0.5 * kl)
    assert float(loss) == pytest.approx(sum(expected) / 3, rel=1e-5)
    torch.testing.assert_close(stats["ratio"][:3], torch.exp(new_lp - old[:, 1]).detach()[:3])
    assert stats["clipped"].tolist()[:3] == [1.0, 1.0, 0.0]
    loss.backward()
    assert float(new_lp.grad[3]) == 0.0  # the masked sample gets no gradient
    assert float(new_lp.grad[0]) == 0.0  # A > 0, rho > 1 + eps: clipped, no gradient
    assert float(new_lp.grad[2]) != 0.0


def test_reference_policy_is_the_base_model(make_trainer, base_pipe):
    from trl_flow.kernels import kernel_mean_std
    from trl_flow.models import get_adapter, index_embeds

    trainer = make_trainer(beta=0.04, guidance_scale=4.5, max_steps=2, learning_rate=3e-3)
    rollout = trainer.make_rollout(0)
    idx, k = torch.arange(4), 1
    out = trainer.forward_step(rollout, idx, k, need_ref=True)
    assert torch.equal(out.ref_mean, out.mean.detach())  # LoRA B = 0 at init: policy == reference exactly
    trainer.train()
    out = trainer.forward_step(rollout, idx, k, need_ref=True)
    adapter = get_adapter(base_pipe)
    x = rollout.states[idx, k]
    with torch.no_grad():
        v = adapter.velocity(base_pipe.transformer, x, rollout.schedule.timesteps[k],
                             index_embeds(rollout.embeds, idx),
                             4.5)
    mean, _ = kernel_mean_std("flow_sde", x, v, rollout.schedule.sigmas[k], rollout.schedule.sigmas[k + 1], 0.7)
    assert torch.equal(out.ref_mean, mean)
    assert not torch.equal(out.mean.detach(), mean)
    assert log_at(trainer, 2, "kl") > 0


# ------------------------------------------------------------------------------------- what is trained
def test_only_lora_weights_change(make_trainer, fresh_pipe):
    pipe = fresh_pipe()
    trainer = make_trainer(pipe=pipe, beta=0.04, max_steps=2)
    before = all_params(pipe)
    assert any("lora_" in n for n in before)
    trainer.train()
    diff = changed(before, all_params(pipe))
    assert diff, "no weight changed"
    assert all("lora_" in n for n in diff), [n for n in diff if "lora_" not in n]
    assert any("lora_B" in n for n in diff)
    assert all(torch.isfinite(p).all() for p in all_params(pipe).values())


def test_adapters_disabled_equal_base_pipeline(make_trainer, fresh_pipe, base_pipe):
    pipe = fresh_pipe()
    trainer = make_trainer(pipe=pipe, max_steps=2, learning_rate=3e-3, guidance_scale=4.5, beta=0.04)
    trainer.train()
    base = pipe_latents(base_pipe)
    with trainer.reference_policy() as ref:
        assert ref is pipe.transformer
        disabled = pipe_latents(pipe)
    assert torch.equal(disabled, base)
    enabled = pipe_latents(pipe)  # adapters are back on afterwards, and the LoRA changed the output
    assert not torch.equal(enabled, base)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_brightness_reward_moves_the_policy(make_trainer, sign):
    def signed_brightness(images, prompts, **kwargs):
        return sign * images.mean(dim=(1, 2, 3))

    # A single-seed check calibrated on the by-prompt layout (at other seeds, either layout can move less than the
    # bound in 20 steps); the mixed default's learning is measured by the shapes benchmark's `*_mixed` runs.
    trainer = make_trainer(rewards=[signed_brightness], max_steps=20, learning_rate=6e-3, clip_range=0.1, beta=0.0,
                           lora_r=4, lora_alpha=32, per_device_train_batch_size=4, guidance_scale=1.0,
                           batch_layout="by_prompt")
    before = trainer.generate(PROMPTS, seed=123)[0].mean().item()
    trainer.train()
    after = trainer.generate(PROMPTS, seed=123)[0].mean().item()
    print(f"brightness {sign:+}: {before:.5f} -> {after:.5f}")
    assert sign * (after - before) > 2e-3, (before, after)
    rewards = [e["reward"] for e in trainer.state.log_history]
    assert sum(rewards[-5:]) > sum(rewards[:5])  # the training reward rose too


# ------------------------------------------------------------------------------------------ save / load
def test_save_model_roundtrip_with_alpha_not_r(make_trainer, fresh_pipe, tmp_path):
    trainer = make_trainer(lora_r=4, lora_alpha=12, max_steps=2, learning_rate=3e-3)
    trainer.train()
    out = trainer.save_model(str(tmp_path / "final"))
    assert os.path.isfile(os.path.join(out, LORA_WEIGHT_NAME))
    pipe2 = fresh_pipe()
    pipe2.load_lora_weights(out)
    layer = pipe2.transformer.transformer_blocks[0].attn.to_q
    assert list(layer.scaling.values()) == [3.0]  # alpha / r survived
    for gs in (1.0, 4.5):
        expected = pipe_latents(trainer.pipe, guidance_scale=gs, output_type="pt")
        assert torch.equal(pipe_latents(pipe2, guidance_scale=gs, output_type="pt"), expected)
    base = pipe_latents(fresh_pipe(), guidance_scale=4.5, output_type="pt")
    assert not torch.equal(pipe_latents(pipe2, guidance_scale=4.5, output_type="pt"), base)


def _resume_config(tmp_path, name, **kw):
    return tiny_config(tmp_path, output_dir=str(tmp_path / name), beta=0.04, ema_decay=0.9, num_inner_epochs=2,
                       learning_rate=3e-3, **kw)


#: shared_prefix (tests/test_shared_prefix.py): window of 1 in [0, 3): branch steps 0, 1, 0, 1 at iterations 1-4.
SHARED_PREFIX = dict(same_noise_per_group=True, shared_prefix=True, sde_window_size=1, sde_window_range=3)


#: Flow-GRPO-Fast's settings (docs/performance.md): a window of 2 trained in one call, only its steps stored (on the
#: CPU), embeddings cached across iterations (the cache is rebuilt on resume: bit for bit the same values)
FAST = dict(SHARED_PREFIX, sde_window_size=2, sde_window_range=2, batch_replay_steps=True,
            trajectory_storage="trained", offload_rollout_to_cpu=True, cache_prompt_embeds=True)


@pytest.mark.parametrize("extra", [{}, SHARED_PREFIX, FAST], ids=["default", "shared_prefix", "fast"])
def test_resume_repeats_an_uninterrupted_run(tmp_path, fresh_pipe, extra):
    ds = list(PROMPTS) + ["a house", "a tree", "a boat"]  # 7 prompts: iterations cross an epoch boundary
    torch.manual_seed(0)  # only matters if the trainer did not seed the LoRA init from config.seed itself
    run_a = FlowGRPOTrainer(_resume_config(tmp_path, "a", max_steps=4, **extra), fresh_pipe(), [brightness],
                            train_dataset=ds)
    run_a.train()

    torch.manual_seed(0)
    run_b = FlowGRPOTrainer(_resume_config(tmp_path, "b", max_steps=2, save_steps=2, **extra), fresh_pipe(),
                            [brightness], train_dataset=ds)
    run_b.train()
    ckpt = tmp_path / "b" / "checkpoint-2"
    assert ckpt.is_dir()
    del run_b

    torch.manual_seed(1234)  # a different global RNG state: everything must come from the checkpoint
    resumed = FlowGRPOTrainer(_resume_config(tmp_path, "b", max_steps=4, save_steps=2, **extra), fresh_pipe(),
                              [brightness], train_dataset=ds)
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert resumed.state.global_step == 4
    wa, wb = lora_params(run_a), lora_params(resumed)
    assert wa.keys() == wb.keys() and wa
    assert not changed(wa, wb)
    for a, b in zip(run_a.ema.shadow_params, resumed.ema.shadow_params):
        assert torch.equal(a, b)
    for step in (3, 4):
        for key in ("loss", "reward", "kl", "ratio_max", "rows/rollout_transformer"):
            assert log_at(resumed, step, key) == log_at(run_a, step, key), (step, key)
    assert [e["step"] for e in resumed.state.log_history] == [1, 2, 3, 4]  # the history was restored too
    if extra is SHARED_PREFIX:  # iteration 4 branches at step 1: its prefix step ran on P rows, not P x G
        assert log_at(resumed, 4, "rows/rollout_transformer") < log_at(resumed, 3, "rows/rollout_transformer")


def test_save_total_limit_rotates_checkpoints(make_trainer, tmp_path):
    trainer = make_trainer(max_steps=3, save_steps=1, save_total_limit=2)
    trainer.train()
    names = sorted(n for n in os.listdir(trainer.config.output_dir) if n.startswith("checkpoint-"))
    assert names == ["checkpoint-2", "checkpoint-3"]


def test_ema_is_used_for_evaluation_and_saving(make_trainer, fresh_pipe, tmp_path):
    trainer = make_trainer(ema_decay=0.9, max_steps=3, eval_steps=2, learning_rate=3e-3, eval_dataset=PROMPTS[:2])
    trainer.train()
    assert [e["step"] for e in trainer.state.log_history if "eval/reward" in e] == [0, 2, 3]
    raw = [p.detach().clone() for p in trainer.trainable_params]
    trainer.evaluate()
    eval_images = trainer.last_eval_images
    seed = trainer.config.seed + 10_007
    raw_images, _ = trainer.generate(PROMPTS[:2], seed=seed)
    assert not torch.equal(eval_images, raw_images)  # evaluation does not use the raw weights ...
    with trainer.ema_weights():
        ema_images, _ = trainer.generate(PROMPTS[:2], seed=seed)
        ema_latents = pipe_latents(trainer.pipe)
    assert torch.equal(eval_images, ema_images)  # ... but the EMA weights
    out = trainer.save_model(str(tmp_path / "ema_final"))
    for i, p in enumerate(trainer.trainable_params):  # the raw weights are restored after saving
        assert torch.equal(p, raw[i])
    pipe2 = fresh_pipe()
    pipe2.load_lora_weights(out)
    assert torch.equal(pipe_latents(pipe2), ema_latents)
    assert not torch.equal(pipe_latents(pipe2), pipe_latents(trainer.pipe))


# ----------------------------------------------------------------------------------- config variants
def _adam_steps(trainer):
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    return {int(opt.state[p]["step"]) for p in trainer.trainable_params}


def test_num_inner_epochs_two(make_trainer):
    trainer = make_trainer(num_inner_epochs=2, max_steps=2, learning_rate=3e-3, beta=0.04)
    trainer.train()
    # 8 samples / microbatch 4 = 2 optimizer steps per epoch, 2 epochs, 2 iterations
    assert trainer.optimizer_steps_per_iteration == 4
    assert _adam_steps(trainer) == {8}
    for step in (1, 2):
        assert log_at(trainer, step, "ratio_first_max_dev") == 0.0
        assert math.isfinite(log_at(trainer, step, "loss"))
    # the second epoch sees the policy the first one moved: ratios differ from 1 there
    assert any(log_at(trainer, s, "ratio_max") > 1.0 or log_at(trainer, s, "ratio_min") < 1.0 for s in (1, 2))


def test_gradient_accumulation_steps(make_trainer):
    trainer = make_trainer(gradient_accumulation_steps=2, per_device_train_batch_size=2, max_steps=2)
    trainer.train()
    assert _adam_steps(trainer) == {4}  # 4 microbatches of 2, accumulated by 2 -> 2 optimizer steps per iteration


def test_sde_window_trains_only_window_steps(make_trainer):
    K, W = 6, 2
    trainer = make_trainer(num_inference_steps=K, sde_window_size=W, max_steps=4)
    calls, rollouts = [], []
    orig_forward, orig_rollout = trainer.forward_step, trainer.make_rollout

    def forward_step(rollout, idx, k, need_ref):
        calls[-1].add(k)
        return orig_forward(rollout, idx, k, need_ref)

    def make_rollout(step):
        calls.append(set())
        rollouts.append(orig_rollout(step))
        return rollouts[-1]

    trainer.forward_step, trainer.make_rollout = forward_step, make_rollout
    trainer.train()
    starts = set()
    for step, (ks, rollout) in enumerate(zip(calls, rollouts)):
        kinds = trainer._step_kinds(step)
        window = [k for k in range(K) if kinds[k] != "ode"]
        assert len(window) == W and window == list(range(window[0], window[0] + W)) and window[0] < K // 2
        starts.add(window[0])
        assert rollout.extras["step_kinds"] == kinds
        assert ks == set(window), (step, ks, window)
        mask = torch.zeros(K, dtype=torch.bool)
        mask[window] = True
        assert torch.equal(rollout.train_mask, mask.expand(len(rollout), K))
        assert bool((rollout.stds[mask] > 0).all()) and bool((rollout.stds[~mask] == 0).all())
        assert bool((rollout.log_probs[:, ~mask] == 0).all()) and bool((rollout.log_probs[:, mask] != 0).all())
    assert len(starts) > 1  # the window moves between iterations


def test_scale_rewards_batch(make_trainer):
    trainer = make_trainer(max_steps=1)  # the default is the reference code's global std
    assert trainer.config.scale_rewards == "batch"
    trainer.train()
    ro = trainer.last_rollout
    r = ro.rewards.double()
    batch_std = float(r.std(unbiased=False))
    expected = torch.zeros(len(r), dtype=torch.float64)
    for g in ro.group_ids.unique():
        m = ro.group_ids == g
        expected[m] = (r[m] - r[m].mean()) / (batch_std + 1e-4)
    torch.testing.assert_close(ro.advantages.double(), expected.clamp(-5, 5), rtol=1e-4, atol=1e-5)
    group = group_advantages(ro.rewards, ro.group_ids, "group")
    assert not torch.allclose(ro.advantages, group)  # it really is not the group scaling


# ------------------------------------------------------------------------------------------- config / CLI
def test_trl_parser_parses_the_config():
    import trl

    (config,) = trl.TrlParser((FlowGRPOConfig,)).parse_args_into_dataclasses(
        ["--output_dir", "x", "--num_generations", "4", "--reward_weights", "1.0", "2.0"])
    assert config.num_generations == 4 and config.reward_weights == [1.0, 2.0] and config.report_to == []


def test_trl_parser_parses_the_config_with_report_to():
    import trl

    (config,) = trl.TrlParser((FlowGRPOConfig,)).parse_args_into_dataclasses(
        ["--output_dir", "x", "--num_generations", "4", "--reward_weights", "1.0", "2.0", "--report_to", "none",
         "--lora_target_modules", "attn.to_q", "attn.to_v", "--clip_range", "0.01", "--sde_window_size", "2"])
    assert isinstance(config, FlowGRPOConfig)
    assert config.num_generations == 4 and config.reward_weights == [1.0, 2.0] and config.report_to == []
    assert config.lora_target_modules == ["attn.to_q", "attn.to_v"] and config.clip_range == 0.01
    assert config.sde_window_size == 2 and config.output_dir == "x"


def test_every_config_field_has_help():
    for field in dataclasses.fields(FlowGRPOConfig):
        help_text = field.metadata.get("help", "")
        assert isinstance(help_text, str) and len(help_text) > 10, field.name


# ------------------------------------------------------------------------------------------- NaN rewards
def test_partial_nan_rewards_train_without_nan(make_trainer):
    def half_nan(images, prompts, **kwargs):
        vals = images.mean(dim=(1, 2, 3)).tolist()
        return [NAN if i % 2 else v for i, v in enumerate(vals)]

    trainer = make_trainer(rewards=[half_nan], max_steps=3, beta=0.04, learning_rate=3e-3)
    before = lora_params(trainer)
    trainer.train()
    after = lora_params(trainer)
    assert changed(before, after)
    assert all(bool(torch.isfinite(p).all()) for p in after.values())
    ro = trainer.last_rollout
    nan = torch.isnan(ro.rewards)
    assert nan.tolist() == [bool(i % 2) for i in range(len(ro))]
    assert not bool(ro.train_mask[nan].any()) and bool(ro.train_mask[~nan][:, :-1].all())
    assert bool((ro.advantages[nan] == 0).all())
    for step in (1, 2, 3):
        assert log_at(trainer, step, "no_reward_frac") == 0.5
        assert math.isfinite(log_at(trainer, step, "loss")) and log_at(trainer, step, "nonfinite_skipped") == 0


@pytest.mark.parametrize("case", ["first_iteration_default_weight_decay", "after_a_valid_iteration_no_decay"])
def test_all_nan_rewards_leave_weights_unchanged(make_trainer, case):
    state = {"nan": case == "first_iteration_default_weight_decay"}

    def maybe_nan(images, prompts, **kwargs):
        return [NAN] * len(prompts) if state["nan"] else images.mean(dim=(1, 2, 3)).tolist()

    extra = {} if state["nan"] else {"weight_decay": 0.0}
    trainer = make_trainer(rewards=[maybe_nan], max_steps=1, beta=0.04, learning_rate=3e-3, **extra)
    if not state["nan"]:
        trainer.train()  # one normal iteration: Adam has momentum now
        state["nan"] = True
        trainer.config.max_steps = 2
    before = lora_params(trainer)
    trainer.train()
    assert trainer.state.log_history[-1]["no_reward_frac"] == 1.0
    assert not changed(before, lora_params(trainer))


# --------------------------------------------------------------------------------------------- seeding
def test_same_seed_gives_the_same_run(make_trainer, tmp_path):
    """Two runs with the same config.seed are identical, whatever the global RNG state (the LoRA init included)."""
    torch.manual_seed(1)
    a = make_trainer(max_steps=1, output_dir=str(tmp_path / "a"))
    torch.manual_seed(2)
    b = make_trainer(max_steps=1, output_dir=str(tmp_path / "b"))
    assert not changed(lora_params(a), lora_params(b))
    a.train()
    b.train()
    assert not changed(lora_params(a), lora_params(b))
