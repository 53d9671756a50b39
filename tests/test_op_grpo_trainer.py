"""Tests for trl_flow.OPGRPOTrainer (OP-GRPO, arXiv 2604.04142): hybrid rollouts from the replay buffer, late-step
truncation, the sequence-level importance correction and its ablations, checkpoints and metrics.

Everything runs on the tiny offline SD3 pipeline (32x32, 4 sampling steps, LoRA r=4). With
``per_device_train_batch_size=1`` every forward pass sees one sample, so log-probs recomputed on CPU are bit-identical
to the ones stored at sampling time; several tests rely on that to compare with ``torch.equal``.
"""

import copy
import math
import os
import warnings

import pytest
import torch

from trl_flow import FlowGRPOConfig, FlowGRPOTrainer, OPGRPOConfig, OPGRPOTrainer
from trl_flow.replay_buffer import ReplayBuffer
from trl_flow.testing import tiny_sd3_pipeline

K = 4  # sampling steps (the last one is the deterministic ODE step, never trained)
K_OFF = 2
PROMPTS = [f"prompt {i}" for i in range(4)]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # 2 shared cores: a multi-threaded forward of the tiny model is >10x slower than a single-threaded one here.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def mean_pixel(images, prompts, **kwargs):
    """Smooth, deterministic reward: the mean pixel value of each image."""
    return images.float().mean(dim=(1, 2, 3)).tolist()


def make_config(tmp_path, **kwargs):
    base = dict(
        output_dir=str(tmp_path), max_steps=2, num_generations=2, prompts_per_step=2, off_policy_fraction=0.25,
        height=32, width=32, num_inference_steps=K, truncation_step=K_OFF, per_device_train_batch_size=1,
        max_sequence_length=16, guidance_scale=1.0, beta=0.0, lora_r=4, lora_alpha=8, disable_tqdm=True,
    )
    base.update(kwargs)
    return OPGRPOConfig(**base)


def make_trainer(tmp_path, reward=mean_pixel, dataset=PROMPTS, replay_buffer=None, lora_seed=0, **kwargs):
    # Perturb the global RNG: the LoRA init must depend on config.seed only
    # (test_lora_init_is_a_function_of_config_seed).
    torch.manual_seed(lora_seed)
    return OPGRPOTrainer(make_config(tmp_path, **kwargs), tiny_sd3_pipeline(), [reward], train_dataset=list(dataset),
                         replay_buffer=replay_buffer)


def lora_params(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def perturb_lora(trainer, scale=2.0, seed=0):
    """Move the current policy away from the behaviour policy (as an update would), deterministically."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in trainer.model.named_parameters():
            if "lora_B" in n:
                p.add_(scale * torch.randn(p.shape, generator=g))


def replayed(rollout):
    return torch.nonzero(rollout.extras["is_replay"]).flatten().tolist()


def spy_behaviour(trainer):
    """Record ``rollout.log_probs`` as they are right before ``_correct_off_policy`` replaces them."""
    seen = {}
    orig = trainer._correct_off_policy

    def spy(rollout):
        seen["log_probs"] = rollout.log_probs.clone()
        return orig(rollout)

    trainer._correct_off_policy = spy
    return seen


@torch.no_grad()
def current_log_prob(trainer, rollout, i, k):
    """Log-prob of the stored transition x_k -> x_{k+1} of sample i under the current policy (batch of one)."""
    return trainer.forward_step(rollout, torch.tensor([i]), k, need_ref=False).log_prob[0]


def best_of_group(rollout, prompt):
    rows = [j for j, p in enumerate(rollout.prompts) if p == prompt]
    return max(rows, key=lambda j: float(rollout.rewards[j]))


# ---------------------------------------------------------------------------------- unchanged policy: w = rho = 1
@pytest.mark.parametrize("batch_size", [1, 4])
def test_unchanged_policy_gives_unit_weights_and_first_ratio(tmp_path, batch_size):
    tr = make_trainer(tmp_path, per_device_train_batch_size=batch_size, guidance_scale=4.5)
    tr.make_rollout(0)
    assert len(tr.replay_buffer) == 2
    r = tr.make_rollout(1)  # no update in between: behaviour policy == current policy
    rep = replayed(r)
    assert len(rep) == 1
    w = r.extras["is_weights"]
    assert w.shape == (4, K)
    if batch_size == 1:
        assert torch.equal(w, torch.ones_like(w))
        assert r.extras["metrics"]["is_weight/mean"] == 1.0 and r.extras["metrics"]["is_weight/max"] == 1.0
        assert r.extras["metrics"]["fresh_logp_recompute_dev"] == 0.0
    else:  # the replayed sample was sampled in another batch composition
        assert float((w - 1).abs().max()) <= 1e-5
        assert abs(r.extras["metrics"]["is_weight/mean"] - 1.0) <= 1e-5
    assert r.extras["metrics"]["is_weight/ess"] == pytest.approx(1.0, abs=1e-6)
    # first ratio: the first microbatch, re-scored as the update's first pass does it, reproduces logp_old exactly
    tr.model.train()
    idx = torch.arange(0, batch_size)
    for k in range(K - 1):
        lp = tr.forward_step(r, idx, k, need_ref=False).log_prob
        assert torch.equal(lp.detach(), r.log_probs[idx, k]), k


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """3 iterations, CFG and KL on, lr large enough that iterations 1 and 2 replay genuinely off-policy data."""
    tmp = tmp_path_factory.mktemp("trained")
    tr = make_trainer(tmp, max_steps=3, prompts_per_step=4, num_generations=2, guidance_scale=4.5, beta=0.04,
                      learning_rate=1e-2, dataset=[f"p{i}" for i in range(8)])
    tr.train()
    return tr


def test_first_ratio_is_one_in_training(trained):
    logs = trained.state.log_history
    assert [e["step"] for e in logs] == [1, 2, 3]
    for e in logs:
        assert e["ratio_first_max_dev"] == 0.0, e
    # ... although the later iterations replayed data that is off-policy (weights != 1)
    assert any(abs(e["is_weight/mean"] - 1.0) > 1e-6 for e in logs[1:]), [e.get("is_weight/mean") for e in logs]


# ------------------------------------------------------------------------------------- late-step truncation
def test_truncation_reuses_prefix_and_regenerates_and_rescores_tail(tmp_path):
    tr = make_trainer(tmp_path, off_policy_correction="per_step")
    r0 = tr.make_rollout(0)
    entries = {e.prompt: e for e in tr.replay_buffer}  # stored objects: replaced, never modified in place
    assert set(entries) == set(r0.prompts)
    perturb_lora(tr)  # the current policy differs from the one that produced the buffer
    seen = spy_behaviour(tr)
    r1 = tr.make_rollout(1)
    (i,) = replayed(r1)
    e = entries[r1.prompts[i]]
    j = best_of_group(r0, e.prompt)  # the trajectory that was buffered
    assert torch.equal(e.states, r0.states[j, : K_OFF + 1]) and e.reward == float(r0.rewards[j])
    # prefix: states and behaviour log-probs reused bit for bit
    assert torch.equal(r1.states[i, : K_OFF + 1], e.states)
    assert torch.equal(seen["log_probs"][i, :K_OFF], e.log_probs)
    assert torch.equal(r1.log_probs[i, :K_OFF], e.log_probs)  # per_step keeps logp_off on the reused steps
    # ... and they are really off-policy now
    assert all(abs(float(current_log_prob(tr, r1, i, k) - e.log_probs[k])) > 1e-6 for k in range(K_OFF))
    # tail: regenerated (differs from the original trajectory at every later state) by the CURRENT policy
    for k in range(K_OFF + 1, K + 1):
        assert not torch.allclose(r1.states[i, k], r0.states[j, k], atol=1e-3), k
    for k in range(K_OFF, K - 1):
        assert torch.equal(seen["log_probs"][i, k], current_log_prob(tr, r1, i, k)), k
        assert bool(r1.train_mask[i, k])
    # reward re-scored on the new final image
    new_reward = mean_pixel(tr.decode(r1.states[i : i + 1, -1]), [e.prompt])[0]
    assert float(r1.rewards[i]) == torch.tensor(new_reward, dtype=torch.float32).item()
    assert float(r1.rewards[i]) != e.reward


def test_truncation_step_equal_to_num_steps_keeps_whole_trajectory(tmp_path):
    tr = make_trainer(tmp_path, truncation_step=K)
    r0 = tr.make_rollout(0)
    entries = {e.prompt: e for e in tr.replay_buffer}
    perturb_lora(tr)
    r1 = tr.make_rollout(1)
    (i,) = replayed(r1)
    e = entries[r1.prompts[i]]
    j = best_of_group(r0, e.prompt)
    assert e.states.shape[0] == K + 1
    assert torch.equal(r1.states[i], e.states) and torch.equal(r1.states[i], r0.states[j])  # nothing regenerated
    assert float(r1.rewards[i]) == e.reward  # same final image, same reward
    # every trained step is reused, so the sequence weight covers them all
    trained_steps = r1.train_mask[i].nonzero().flatten().tolist()
    assert trained_steps == list(range(K - 1))
    assert torch.equal(r1.extras["reused"][i], r1.train_mask[i])
    assert float(r1.extras["is_weights"][i, 0]) != 1.0


# ---------------------------------------------------------------------------------------- hybrid rollout
def test_at_g4_both_descriptions_hold_one_buffered_in_every_group(tmp_path):
    """The shapes label op_grpo_g4_one (docs/op_grpo.md): G = 4, every group replays (replay_unit="group",
    off_policy_fraction 1): 3 fresh + 1 buffered per group, so 25% of the samples; one trajectory per prompt in the
    buffer; late truncation (the default truncation_fraction: only the last trained step regenerated)."""
    P, G = 4, 4
    tr = make_trainer(tmp_path, prompts_per_step=P, num_generations=G, replay_unit="group", off_policy_fraction=1.0,
                      truncation_step=None, per_device_train_batch_size=4)
    assert tr.replay_buffer.per_prompt == 1 and tr.config.resolved_truncation_step == K - 2  # k_off 2 of 4
    tr.make_rollout(0)
    assert all(len([e for e in tr.replay_buffer if e.prompt == p]) == 1 for p in PROMPTS)
    r = tr.make_rollout(1)
    rep = replayed(r)
    assert r.extras["metrics"]["off_policy_share"] == 0.25 and len(rep) == P
    assert sorted(int(r.group_ids[i]) for i in rep) == list(range(P))  # one in every group


def test_group_unit_replays_one_trajectory_in_a_share_of_groups(tmp_path):
    # replay_unit="group" (the form before the replay-share change): off_policy_fraction is the share of GROUPS, one
    # buffered trajectory each, one buffer entry per prompt
    P, G = 4, 3
    tr = make_trainer(tmp_path, prompts_per_step=P, num_generations=G, replay_unit="group", off_policy_fraction=0.5)
    assert tr.replay_buffer.per_prompt == 1
    r0 = tr.make_rollout(0)
    assert not r0.extras["is_replay"].any() and r0.extras["metrics"]["off_policy_share"] == 0.0
    assert sorted(tr.replay_buffer.prompts) == sorted(PROMPTS)  # the buffer holds every prompt of the dataset
    r = tr.make_rollout(1)
    rep = replayed(r)
    assert len(r) == P * G and len(rep) == 2
    assert r.extras["metrics"]["off_policy_share"] == 2 / (P * G)
    fresh = [i for i in range(len(r)) if i not in rep]
    for i in rep:
        g = int(r.group_ids[i])
        members = [m for m in range(len(r)) if int(r.group_ids[m]) == g]
        assert len(members) == G and sum(m in fresh for m in members) == G - 1
        assert {r.prompts[m] for m in members} == {r.prompts[i]}
    assert len({int(r.group_ids[i]) for i in rep}) == 2
    assert sorted(set(int(g) for g in r.group_ids)) == list(range(P))
    # the two fresh-only groups have G samples each
    fresh_only = set(range(P)) - {int(r.group_ids[i]) for i in rep}
    assert all(int((r.group_ids == g).sum()) == G for g in fresh_only)
    # replayed prompts are not also fresh prompts of this iteration (the buffer holds all 4, so this is real)
    rep_prompts = {r.prompts[i] for i in rep}
    fresh_prompts = {r.prompts[i] for i in fresh if int(r.group_ids[i]) in fresh_only}
    assert len(rep_prompts) == 2 and len(fresh_prompts) == 2 and not rep_prompts & fresh_prompts
    # only FRESH trajectories are offered: a replayed prompt's entry is either the old one or its best fresh sample
    for i in rep:
        e = tr.replay_buffer.get(r.prompts[i])
        if e.step == 1:
            members = [m for m in fresh if int(r.group_ids[m]) == int(r.group_ids[i])]
            best = max(members, key=lambda m: float(r.rewards[m]))
            assert torch.equal(e.states, r.states[best, : K_OFF + 1]) and e.reward == float(r.rewards[best])
        else:
            assert e.step == 0


@pytest.mark.parametrize("replay_baseline", ["group", "fresh"])
def test_replay_baseline_sets_which_samples_make_the_group_statistics(tmp_path, replay_baseline):
    # every group replays 2 of its 4 samples (off_policy_fraction=0.5 of the samples)
    P, G = 2, 4
    tr = make_trainer(tmp_path, prompts_per_step=P, num_generations=G, off_policy_fraction=0.5,
                      replay_baseline=replay_baseline, scale_rewards="group")
    tr.make_rollout(0)
    r = tr.make_rollout(1)
    tr.compute_advantages(r)
    rep = replayed(r)
    assert len(rep) == P * G // 2
    for i in rep:
        members = [m for m in range(len(r)) if int(r.group_ids[m]) == int(r.group_ids[i])]
        assert sum(m in rep for m in members) == 2
        stats = members if replay_baseline == "group" else [m for m in members if m not in rep]
        rw = r.rewards[stats].double()
        std = float(rw.std(unbiased=False))
        if std < 1e-4:  # equal baseline rewards: the whole group's std scales (group_advantages)
            std = float(r.rewards[members].double().std(unbiased=False))
        for m in members:
            expected = (float(r.rewards[m]) - float(rw.mean())) / (std + 1e-4)
            assert float(r.advantages[m]) == pytest.approx(max(-5.0, min(5.0, expected)), rel=1e-3, abs=1e-5)
        if replay_baseline == "fresh":  # the fresh samples' advantages sum to 0 without the replayed ones
            assert abs(float(r.advantages[[m for m in members if m not in rep]].sum())) < 1e-4


def test_replayed_trajectory_is_not_offered_to_the_buffer(tmp_path):
    seen_images = []

    def favours_replays(images, prompts, **kwargs):
        """mean pixel, but 1000 for an image already scored in an earlier call (a replayed, untruncated one)."""
        out = [1000.0 if any(torch.equal(img, s) for s in seen_images) else v
               for img, v in zip(images, mean_pixel(images, prompts))]
        seen_images.extend(images.clone())
        return out

    # 2 groups replay 2 of their 4 samples each; the buffer keeps the best 2 fresh trajectories of a prompt
    tr = make_trainer(tmp_path, reward=favours_replays, truncation_step=K, prompts_per_step=4, num_generations=4)
    tr.make_rollout(0)
    old = {p: tr.replay_buffer.entries_of(p) for p in tr.replay_buffer.prompts}
    assert all(len(v) == 2 for v in old.values())
    r = tr.make_rollout(1)
    rep = replayed(r)
    assert len(rep) == 4 and all(float(r.rewards[i]) == 1000.0 for i in rep)  # the best of their groups
    for i in rep:
        fresh = [m for m in range(len(r)) if int(r.group_ids[m]) == int(r.group_ids[i]) and m not in rep]
        top2 = sorted(fresh, key=lambda m: -float(r.rewards[m]))[:2]
        for e in tr.replay_buffer.entries_of(r.prompts[i]):
            assert any(e is o for o in old[r.prompts[i]]) or (
                e.step == 1 and any(
                    e.reward == float(r.rewards[m]) and torch.equal(e.states, r.states[m]) for m in top2))
            assert e.reward < 1000.0


def test_short_buffer_does_not_duplicate_a_fresh_prompt(tmp_path):
    P, G = 4, 2
    tr = make_trainer(tmp_path, prompts_per_step=P, num_generations=G)
    tr.make_rollout(0)
    from trl_flow.data import prompt_indices

    rows1 = [PROMPTS[i] for i in prompt_indices(len(PROMPTS), P, 1, tr.config.seed)]
    # a buffer holding the prompts of rows 0, 1 (fresh, excluded) and row 2 (replayed; row 3 then becomes fresh
    # while the buffer runs short of the 2 replayed groups asked for)
    short = ReplayBuffer(capacity=8)
    for p in rows1[:3]:
        short.offer(tr.replay_buffer.get(p), now=0)
    tr.replay_buffer = short
    r = tr.make_rollout(1)
    rep = replayed(r)
    assert len(rep) == 1 and r.prompts[rep[0]] == rows1[2]
    rep_group = int(r.group_ids[rep[0]])
    fresh_group_prompts = {r.prompts[i] for i in range(len(r)) if int(r.group_ids[i]) != rep_group}
    assert r.prompts[rep[0]] not in fresh_group_prompts, (r.prompts[rep[0]], fresh_group_prompts)
    assert fresh_group_prompts == {rows1[0], rows1[1], rows1[3]}


@pytest.mark.parametrize("dataset", [["one prompt"], ["prompt a", "prompt b"]])
def test_fewer_distinct_prompts_than_groups_still_replays(tmp_path, dataset):
    # every iteration repeats its prompts, so excluding the fresh ones would leave nothing to replay (one prompt:
    # OP-GRPO silently became Flow-GRPO); a replayed group then shares its prompt with fresh groups
    P, G = 4, 3
    tr = make_trainer(tmp_path, dataset=dataset, prompts_per_step=P, num_generations=G)
    tr.make_rollout(0)
    assert sorted(tr.replay_buffer.prompts) == sorted(dataset)
    r = tr.make_rollout(1)
    rep = replayed(r)
    # G = 3: at most G // 2 = 1 replayed per group, one entry per prompt; as many groups as the buffer has prompts
    assert tr.config.replay_sizes() == [1, 1, 1]
    n_off = min(3, len(dataset))
    assert n_off >= 1 and len(rep) == n_off and len({r.prompts[i] for i in rep}) == n_off
    assert r.extras["metrics"]["off_policy_share"] == n_off / (P * G) and len(r) == P * G
    for i in rep:  # each replayed trajectory sits in a group of G-1 fresh samples of its prompt
        members = [m for m in range(len(r)) if int(r.group_ids[m]) == int(r.group_ids[i])]
        assert len(members) == G and {r.prompts[m] for m in members} == {r.prompts[i]}
    assert sorted(set(int(x) for x in r.group_ids)) == list(range(P))


def test_zero_fraction_never_replays_and_is_flow_grpo(tmp_path):
    tr = make_trainer(tmp_path / "op", off_policy_fraction=0.0, max_steps=3, learning_rate=1e-2)
    tr.train()
    assert len(tr.replay_buffer) > 0  # the buffer is filled, just never used
    for e in tr.state.log_history:
        assert e["off_policy_share"] == 0.0 and "is_weight/mean" not in e
    assert not tr.last_rollout.extras["is_replay"].any()
    assert not tr.last_rollout.extras["reused"].any()
    # same training as the Flow-GRPO baseline, bit for bit
    cfg = tr.config
    fg_cfg = FlowGRPOConfig(**{f: getattr(cfg, f) for f in FlowGRPOConfig.__dataclass_fields__})
    fg_cfg.output_dir = str(tmp_path / "fg")
    torch.manual_seed(0)
    fg = FlowGRPOTrainer(fg_cfg, tiny_sd3_pipeline(), [mean_pixel], train_dataset=list(PROMPTS))
    fg.train()
    a, b = lora_params(tr), lora_params(fg)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[n], b[n]) for n in a)
    init = lora_params(make_trainer(tmp_path / "init"))
    assert not all(torch.equal(v, init[n]) for n, v in a.items())  # and it did train


# ------------------------------------------------------------------------------------ importance corrections
def test_corrections_against_independent_computation(tmp_path):
    P = 4
    tr = make_trainer(tmp_path, prompts_per_step=P, learning_rate=1e-12)  # optimize() below must not move the policy
    tr.make_rollout(0)
    entries = {e.prompt: e for e in tr.replay_buffer}
    perturb_lora(tr)
    snapshot = copy.deepcopy(tr.replay_buffer)

    def rollout_with(correction, cap=None):
        tr.config.off_policy_correction = correction
        tr.config.importance_weight_cap = cap
        tr.replay_buffer = copy.deepcopy(snapshot)
        return tr.make_rollout(1)

    r = rollout_with("sequence")
    rep = replayed(r)
    assert len(rep) == 2
    fresh = [i for i in range(len(r)) if i not in rep]
    trained_steps = list(range(K - 1))
    old = {(i, k): current_log_prob(tr, r, i, k) for i in range(len(r)) for k in trained_steps}
    w = {}
    for i in rep:
        e = entries[r.prompts[i]]
        log_w = sum(float(old[i, k]) - float(e.log_probs[k]) for k in range(K_OFF))
        w[i] = math.exp(log_w)
        # genuinely off-policy at every reused step, so the checks below can fail
        assert all(abs(float(old[i, k] - e.log_probs[k])) > 1e-3 for k in range(K_OFF))
    W = r.extras["is_weights"]
    for i in rep:
        assert torch.allclose(W[i, :K_OFF], torch.full((K_OFF,), w[i]), rtol=1e-5, atol=0), (W[i], w[i])
        assert torch.equal(W[i, K_OFF:], torch.ones(K - K_OFF))  # regenerated tail: on-policy
    assert torch.equal(W[fresh], torch.ones(len(fresh), K))
    for i in range(len(r)):  # logp_old recomputed under the current weights everywhere
        for k in trained_steps:
            assert torch.equal(r.log_probs[i, k], old[i, k]), (i, k)
    m = r.extras["metrics"]
    ws = torch.tensor([w[i] for i in rep], dtype=torch.float64)
    assert m["is_weight/mean"] == pytest.approx(float(ws.mean()), rel=1e-5)
    assert m["is_weight/max"] == pytest.approx(float(ws.max()), rel=1e-5)
    assert m["is_weight/ess"] == pytest.approx(float(ws.sum() ** 2 / (len(ws) * (ws**2).sum())), rel=1e-5)
    # the weight multiplies the whole clipped objective: loss = w * max(-A rho, -A clip(rho)) = -A w at rho = 1, for
    # both signs of A and both sides of w = 1 (the earlier max(-A w rho, -A clip(rho)) gives -A min(w, 1) or
    # -A max(w, 1) for one sign of A: this fails on it), and its gradient w.r.t. the log-prob is -A w too
    for i in rep:
        for a in (1.0, -1.0):
            r.advantages = torch.full((len(r),), a)
            out = tr.forward_step(r, torch.tensor([i]), 0, need_ref=False)
            loss, stats = tr.compute_loss(r, torch.tensor([i]), 0, out)
            assert float(loss) == pytest.approx(-a * w[i], rel=1e-5), (i, a)
            (g,) = torch.autograd.grad(loss, out.log_prob)
            assert float(g) == pytest.approx(-a * w[i], rel=1e-5), (i, a)
            assert float(stats["clip_frac_weighted_off_policy"]) == 0.0

    r_seq = r

    r = rollout_with("per_step")
    r_per_step = r
    assert replayed(r) == rep
    assert torch.equal(r.extras["is_weights"], torch.ones(len(r), K))
    for i in range(len(r)):
        for k in trained_steps:
            expected = entries[r.prompts[i]].log_probs[k] if (i in rep and k < K_OFF) else old[i, k]
            assert torch.equal(r.log_probs[i, k], expected), (i, k)

    r = rollout_with("none")
    assert torch.equal(r.extras["is_weights"], torch.ones(len(r), K))
    for i in range(len(r)):
        for k in trained_steps:
            assert torch.equal(r.log_probs[i, k], old[i, k]), (i, k)

    cap = math.sqrt(w[rep[0]] * w[rep[1]])  # between the two weights: exactly one of them is capped
    r = rollout_with("sequence", cap=cap)
    W = r.extras["is_weights"]
    for i in rep:
        assert float(W[i, 0]) == pytest.approx(min(w[i], cap), rel=1e-5)
        assert float(W[i, 0]) <= torch.tensor(cap, dtype=torch.float32).item()
    assert sum(float(W[i, 0]) == pytest.approx(cap, rel=1e-6) for i in rep) == 1
    assert torch.equal(W[fresh], torch.ones(len(fresh), K))
    assert r.extras["metrics"]["is_weight/max"] <= cap * (1 + 1e-6)

    # clip fractions: the sequence correction keeps rho = pi_theta / pi_old (== 1 before the update, so nothing is
    # clipped), the naive per-step ratio pi_theta / pi_off is off by > 1e-3 >> clip_range on every reused step
    for r, off_clipped in ((r_seq, 0.0), (r_per_step, 1.0)):
        tr.compute_advantages(r)
        m = tr.optimize(r, 1)
        assert m["clip_frac_on_policy"] == 0.0 and m["clip_frac_off_policy"] == off_clipped, m


# ------------------------------------------------------------------------------------------------ resume
@pytest.mark.parametrize("batch_replay_steps", [False, True])
def test_resume_restores_buffer_and_matches_uninterrupted_run(tmp_path, batch_replay_steps):
    """Also with ``batch_replay_steps`` (UniRL's batched replay, Tencent-Hunyuan/UniRL 0c97cfb8f458,
    unirl/models/types/batched_replay.py:26): the resumed run equals the uninterrupted one bit for bit."""
    kw = dict(save_steps=2, learning_rate=1e-2, prompts_per_step=2, num_generations=2,
              batch_replay_steps=batch_replay_steps)
    full = make_trainer(tmp_path / "full", max_steps=4, **kw)
    full.train()
    half = make_trainer(tmp_path / "resumed", max_steps=2, **kw)
    half.train()
    ckpt = tmp_path / "resumed" / "checkpoint-2"
    assert os.path.isdir(ckpt / "replay_buffer")
    assert ReplayBuffer.load_from_disk(ckpt / "replay_buffer").prompts == half.replay_buffer.prompts
    assert os.path.isdir(tmp_path / "full" / "checkpoint-4" / "replay_buffer")

    resumed = make_trainer(tmp_path / "resumed", max_steps=4, lora_seed=123, **kw)  # fresh pipeline, other init
    assert len(resumed.replay_buffer) == 0
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert resumed.state.global_step == 4
    # replay happened after the resume point, so the buffer mattered
    assert any(e["off_policy_share"] > 0 for e in resumed.state.log_history if e["step"] > 2)
    a, b = lora_params(full), lora_params(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert sorted(full.replay_buffer.prompts) == sorted(resumed.replay_buffer.prompts)
    for e in full.replay_buffer:
        f = resumed.replay_buffer.get(e.prompt)
        assert torch.equal(e.states, f.states) and torch.equal(e.log_probs, f.log_probs)
        assert torch.equal(e.sigmas, f.sigmas)
        assert (e.reward, e.step, e.columns) == (f.reward, f.step, f.columns)
    assert {e.step for e in full.replay_buffer} != {0}  # entries were refreshed after the resume point


# ------------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize("kwargs, field", [
    ({"off_policy_fraction": -0.1}, "off_policy_fraction"),
    ({"off_policy_fraction": 1.5}, "off_policy_fraction"),
    ({"off_policy_fraction": float("nan")}, "off_policy_fraction"),
    ({"truncation_step": 0}, "truncation_step"),
    ({"truncation_step": K + 1}, "truncation_step"),
    ({"off_policy_correction": "x"}, "off_policy_correction"),
    ({"buffer_sampling": "x"}, "buffer_sampling"),
    ({"buffer_capacity": 0}, "buffer_capacity"),
    ({"sde_window_size": 1}, "sde_window_size"),
    ({"importance_weight_cap": 0.0}, "importance_weight_cap"),
    ({"importance_weight_cap": -1.0}, "importance_weight_cap"),
    ({"buffer_decay": -0.1}, "buffer_decay"),
    ({"replay_baseline": "x"}, "replay_baseline"),
])
def test_bad_config_raises_naming_field(tmp_path, kwargs, field):
    with pytest.raises(ValueError, match=field):
        make_config(tmp_path, **kwargs)


def test_config_defaults(tmp_path):
    # the replay-share change: the described form (a 25% share of the samples; only the late tail regenerated). Before
    # it the defaults were k_off = K // 2 = 5 and a 25% share of the groups.
    cfg = OPGRPOConfig(output_dir=str(tmp_path), num_inference_steps=10)
    assert cfg.resolved_truncation_step == 8 and cfg.off_policy_fraction == 0.25
    assert (cfg.replay_unit, cfg.truncation_fraction, cfg.truncation_step) == ("sample", 0.1, None)
    assert (cfg.off_policy_correction, cfg.importance_weight_placement) == ("sequence", "objective")
    assert cfg.replay_baseline == "group"
    assert make_config(tmp_path, truncation_step=K).resolved_truncation_step == K
    buf = make_trainer(tmp_path, buffer_capacity=3, buffer_decay=0.2, buffer_sampling="priority").replay_buffer
    assert (buf.capacity, buf.decay, buf.sampling, len(buf)) == (3, 0.2, "priority", 0)


@pytest.mark.parametrize("kwargs, match", [
    ({"truncation_step": K_OFF + 1}, "truncation_step"),
    ({"num_inference_steps": K + 2}, "sigmas"),  # same k_off, other schedule
])
def test_incompatible_buffer_raises_before_sampling(tmp_path, kwargs, match):
    a = make_trainer(tmp_path / "a")
    a.make_rollout(0)
    a.replay_buffer.save_to_disk(tmp_path / "buf")
    loaded = ReplayBuffer.load_from_disk(tmp_path / "buf")
    if "truncation_step" in kwargs:  # other k_off: refused when the trainer is made
        with pytest.raises(ValueError, match=match):
            make_trainer(tmp_path / "b", replay_buffer=loaded, **kwargs)
        return
    b = make_trainer(tmp_path / "b", replay_buffer=loaded, **kwargs)
    with pytest.raises(ValueError, match=match):
        b.make_rollout(1)


def test_buffer_from_other_resolution_raises_clear_error(tmp_path):
    a = make_trainer(tmp_path / "a")
    a.make_rollout(0)
    b = make_trainer(tmp_path / "b", replay_buffer=a.replay_buffer, height=64, width=64)
    with pytest.raises(ValueError, match="shape|resolution|height"):
        b.make_rollout(1)


# ---------------------------------------------------------------------------------------------- metrics
def test_metrics_logged(trained):
    logs = trained.state.log_history
    keys = ["buffer/size", "buffer/mean_reward", "buffer/mean_age", "off_policy_share", "clip_frac_on_policy",
            "clip_frac_off_policy"]
    for e in logs:
        for key in keys:
            assert key in e and math.isfinite(e[key]), (key, e)
    N = 4 * 2
    # iteration 0: empty buffer, nothing replayed; 4 distinct prompts offered -> 4 entries
    assert logs[0]["off_policy_share"] == 0.0 and logs[0]["buffer/size"] == 4.0
    assert "is_weight/mean" not in logs[0]
    for e in logs[1:]:  # later iterations replay 2 groups of 4: 2 of the 8 samples
        assert e["off_policy_share"] == 2 / N
        assert e["is_weight/mean"] > 0 and e["is_weight/max"] >= e["is_weight/mean"]
        assert 0 < e["is_weight/ess"] <= 1 + 1e-6
        assert 0 <= e["clip_frac_off_policy"] <= 1 and 0 <= e["clip_frac_on_policy"] <= 1
    # with lr 1e-2 the update moves the policy: the off-policy steps get clipped
    assert any(e["clip_frac_off_policy"] > 0 for e in logs[1:])
    # the last entry describes the buffer as it is now (ages counted at the logged step)
    buf = list(trained.replay_buffer)
    last = logs[-1]
    assert last["buffer/size"] == len(buf) <= 8
    assert last["buffer/mean_reward"] == pytest.approx(sum(e.reward for e in buf) / len(buf), rel=1e-9)
    assert last["buffer/mean_age"] == pytest.approx(sum(last["step"] - e.step for e in buf) / len(buf), rel=1e-9)


# ------------------------------------------------------------------------------------------- NaN rewards
def test_nan_rewards_keep_buffer_and_weights_finite(tmp_path):
    def flaky(images, prompts, **kwargs):
        out = mean_pixel(images, prompts)
        return [float("nan") if (p == "prompt 1" or j == 0) else v for j, (p, v) in enumerate(zip(prompts, out))]

    tr = make_trainer(tmp_path, reward=flaky, max_steps=4, num_generations=3, learning_rate=1e-2)
    # the buffer warns when it rejects a non-finite entry: the trainer must not offer one
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="ReplayBuffer", category=RuntimeWarning)
        tr.train()
    logs = tr.state.log_history
    assert any(e["no_reward_frac"] > 0 for e in logs)
    assert any(e["off_policy_share"] > 0 for e in logs)
    buf = list(tr.replay_buffer)
    assert buf and "prompt 1" not in tr.replay_buffer  # no trajectory of that prompt was ever scored
    for e in buf:
        assert math.isfinite(e.reward) and torch.isfinite(e.states).all() and torch.isfinite(e.log_probs).all()
    assert tr.replay_buffer.counters["rejected_nonfinite"] == 0
    for e in logs:
        for key in ("is_weight/mean", "is_weight/max", "is_weight/ess", "buffer/mean_reward", "loss"):
            if key in e:
                assert math.isfinite(e[key]), (key, e)
    assert torch.isfinite(tr.last_rollout.extras["is_weights"]).all()
    assert all(torch.isfinite(p).all() for p in lora_params(tr).values())
    assert logs[-1]["nonfinite_skipped"] == 0


# --------------------------------------------------------------------------------------- reproducibility
def test_lora_init_is_a_function_of_config_seed(tmp_path):
    a = make_trainer(tmp_path / "a", lora_seed=1)
    b = make_trainer(tmp_path / "b", lora_seed=2)
    pa, pb = lora_params(a), lora_params(b)
    assert all(torch.equal(pa[n], pb[n]) for n in pa)


# ------------------------------------------------------------------- the replay-share change: the described form by
# default
def defaults_run(tmp_path, G):
    """A 2-iteration run of OPGRPOConfig()'s defaults, only the sizes changed to fit the tiny pipeline."""
    cfg = OPGRPOConfig(output_dir=str(tmp_path), max_steps=2, num_generations=G, prompts_per_step=2, height=32,
                       width=32, max_sequence_length=16, per_device_train_batch_size=2 * G, disable_tqdm=True)
    defaults = OPGRPOConfig(output_dir=str(tmp_path))
    for f in ("off_policy_fraction", "replay_unit", "truncation_fraction", "truncation_step", "num_inference_steps",
              "sampler", "off_policy_correction", "buffer_capacity", "buffer_decay", "buffer_sampling"):
        assert getattr(cfg, f) == getattr(defaults, f), f
    torch.manual_seed(0)
    tr = OPGRPOTrainer(cfg, tiny_sd3_pipeline(), [mean_pixel], train_dataset=[f"p{i}" for i in range(8)])
    tr.train()
    return tr


@pytest.mark.parametrize("G", [16, 4])
def test_defaults_replay_a_quarter_of_the_samples_and_regenerate_only_the_late_tail(tmp_path, G):
    tr = defaults_run(tmp_path, G)
    logs = tr.state.log_history
    assert logs[0]["off_policy_share"] == 0.0  # empty buffer
    assert abs(logs[1]["off_policy_share"] - 0.25) <= 0.05  # the buffer can serve: a quarter of the SAMPLES
    r = tr.last_rollout
    rep = replayed(r)
    assert len(rep) / len(r) == logs[1]["off_policy_share"] == 0.25
    # each replaying group: at most G // 2 distinct buffered trajectories of its prompt, the rest fresh
    for g in {int(r.group_ids[i]) for i in rep}:
        members = [m for m in range(len(r)) if int(r.group_ids[m]) == g]
        mine = [m for m in members if m in rep]
        assert len(members) == G and 1 <= len(mine) <= G // 2 and len({r.prompts[m] for m in members}) == 1
        for a in mine:
            for b in mine:
                assert a == b or not torch.equal(r.states[a, :9], r.states[b, :9])  # no trajectory twice
    # late-step truncation: the trained steps are every step but the last (K = 10: steps 0..8); the replayed
    # trajectories regenerate only their last ones, at most a third of them, and reuse the rest
    trained = r.trained_steps()
    assert trained == list(range(9))
    reused = r.extras["reused"]
    regenerated = [k for k in trained if not reused[rep][:, k].any()]
    assert all(bool(reused[rep][:, k].all()) for k in trained if k not in regenerated)
    assert 1 <= len(regenerated) <= len(trained) / 3 and regenerated == trained[-len(regenerated):]
    k_off = tr.config.resolved_truncation_step
    assert regenerated == list(range(k_off, 9)) and k_off == 8
    # on this shift-3 schedule the reused prefix ends in the low-noise regime (K // 2 = 5 was sigma 0.71)
    assert float(r.schedule.sigmas[k_off]) < 0.3 < 0.7 < float(r.schedule.sigmas[5])
    # the buffer keeps the best G // 2 distinct fresh trajectories of every prompt
    assert tr.replay_buffer.per_prompt == G // 2
    for p in tr.replay_buffer.prompts:
        entries = tr.replay_buffer.entries_of(p)
        assert 1 <= len(entries) <= G // 2
        assert all(not torch.equal(a.states, b.states) for i, a in enumerate(entries) for b in entries[i + 1:])


def test_sample_unit_layout_and_offers(tmp_path):
    P, G = 4, 4  # 0.25 of 16 samples = 4: two groups replay 2 each (G // 2 at most), two groups are all fresh
    tr = make_trainer(tmp_path, prompts_per_step=P, num_generations=G)
    assert tr.config.replay_sizes() == [2, 2] and tr.replay_buffer.per_prompt == 2
    r0 = tr.make_rollout(0)
    for p in set(r0.prompts):  # the best 2 fresh trajectories of every group were offered (and kept)
        rows = sorted((j for j, q in enumerate(r0.prompts) if q == p), key=lambda j: -float(r0.rewards[j]))[:2]
        kept = tr.replay_buffer.entries_of(p)
        assert sorted(e.reward for e in kept) == sorted(float(r0.rewards[j]) for j in rows)
        assert all(any(torch.equal(e.states, r0.states[j, : K_OFF + 1]) for e in kept) for j in rows)
    served = {p: tr.replay_buffer.entries_of(p) for p in tr.replay_buffer.prompts}  # before iteration 1's offers
    r = tr.make_rollout(1)
    rep = replayed(r)
    assert len(r) == P * G and len(rep) == 4 and r.extras["metrics"]["off_policy_share"] == 0.25
    rep_groups = {int(r.group_ids[i]) for i in rep}
    assert len(rep_groups) == 2 and sorted(set(int(g) for g in r.group_ids)) == list(range(P))
    for g in rep_groups:
        members = [m for m in range(len(r)) if int(r.group_ids[m]) == g]
        mine = [m for m in members if m in rep]
        assert len(members) == G and len(mine) == 2
        # the two replayed trajectories are the prompt's two distinct buffered ones, each once
        stored = served[r.prompts[mine[0]]]
        assert len(stored) == 2
        for m in mine:
            assert sum(torch.equal(r.states[m, : K_OFF + 1], e.states) for e in stored) == 1
        assert not torch.equal(r.states[mine[0], : K_OFF + 1], r.states[mine[1], : K_OFF + 1])
    # replayed prompts are not also fresh groups of this iteration
    rep_prompts = {r.prompts[i] for i in rep}
    fresh_only = set(range(P)) - rep_groups
    assert not rep_prompts & {r.prompts[i] for i in range(len(r)) if int(r.group_ids[i]) in fresh_only}


def _rewrite_checkpoint(ckpt, edit_config):
    """Edit a checkpoint's trainer_config.json as an older trl_flow wrote it, and re-seal its completion marker."""
    import hashlib
    import json

    path = ckpt / "trainer_config.json"
    saved = json.loads(path.read_text())
    edit_config(saved)
    path.write_text(json.dumps(saved))
    marker_file = ckpt / "checkpoint_complete.json"
    marker = json.loads(marker_file.read_text())
    marker["files"]["trainer_config.json"] = {"size": path.stat().st_size,
                                              "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    marker_file.write_text(json.dumps(marker))


def test_checkpoint_of_the_old_meaning_is_refused_unless_asked_for(tmp_path):
    kw = dict(learning_rate=1e-2, prompts_per_step=2, num_generations=2, save_steps=2, truncation_step=None)
    old = make_trainer(tmp_path / "run", max_steps=2, replay_unit="group", off_policy_fraction=0.5, **kw)
    old.train()
    ckpt = tmp_path / "run" / "checkpoint-2"

    def as_before_issue_38(saved):  # no replay_unit / truncation_fraction; the default k_off was K // 2
        del saved["replay_unit"], saved["truncation_fraction"]
        saved["truncation_step"] = K // 2

    _rewrite_checkpoint(ckpt, as_before_issue_38)
    new = make_trainer(tmp_path / "run", max_steps=4, **kw)
    before = lora_params(new)
    with pytest.raises(ValueError, match=r"no `replay_unit`.*replay_unit=group truncation_step=2"):
        new.train(resume_from_checkpoint=str(ckpt))
    after = lora_params(new)
    assert all(torch.equal(before[n], after[n]) for n in before)  # refused before anything was loaded
    # asked for explicitly, the old meaning resumes (the buffer was written with k_off = 2: same meaning)
    kw["truncation_step"] = K // 2
    same = make_trainer(tmp_path / "run", max_steps=4, replay_unit="group", off_policy_fraction=0.5, **kw)
    same.train(resume_from_checkpoint=str(ckpt))
    assert same.state.global_step == 4 and same.replay_buffer.per_prompt == 1
