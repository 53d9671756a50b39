"""``shared_prefix``: the deterministic (ODE) steps before an iteration's first stochastic step run once per group and
the group's G samples branch from that state, as Flow-GRPO-Fast describes (yifan123/flow_grpo README: "Sampling
before branching requires only a single prompt without group expansion"; its scripts/train_sd3_fast.py at 74db691
samples those ODE steps for every sample of the repeated prompts). The transformer rows of those steps are counted
with the ``rows/rollout_transformer`` forward pre-hook: P rows per prefix step instead of P x G."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import PROMPTS, brightness, tiny_config

import trl_flow
import trl_flow.testing
from trl_flow import FlowGRPOConfig, FlowGRPOTrainer
from trl_flow.rollout import branch_step

#: Max abs difference of final states / rewards, shared prefix vs not, on the same weights, measured on the 2-core
#: CPU over 6 iterations: shapes pipeline (CFG 3) 0.0 / 0.0; tiny SD3 pipeline without CFG 7.2e-7 / 1.2e-7 (final
#: states of magnitude ~4.5), with CFG 4.5 0.0 / 0.0. Not 0 in general: a GEMM's last bits depend on its row count
#: (P rows instead of P x G).
TOLERANCE = 1e-5


def _trainer(cls, tmp_path, pipe=None, dataset=None, reward=brightness, **overrides):
    kwargs = dict(num_inference_steps=6, same_noise_per_group=True, shared_prefix=True, sde_window_size=2,
                  sde_window_range=3, sampler="flow_sde", max_steps=1)
    kwargs.update(overrides)
    fields = {f.name for f in dataclasses.fields(cls.config_class)}
    config = tiny_config(tmp_path, cls.config_class, **{k: v for k, v in kwargs.items() if k in fields})
    return cls(config, pipe or trl_flow.testing.tiny_sd3_pipeline(), [reward],
               train_dataset=dataset if dataset is not None else list(PROMPTS))


def _on_and_off(trainer, step):
    """Rollouts of ``step`` with shared_prefix off, then on, on the same weights."""
    trainer.config.shared_prefix = False
    off = trainer.make_rollout(step)
    trainer.config.shared_prefix = True
    on = trainer.make_rollout(step)
    return off, on


def _check_prefix(rollout, s):
    """Stored steps before the branch: every row holds its group's prefix (the same in the group), zero log-probs."""
    assert torch.all(rollout.log_probs[:, :s] == 0) and not rollout.train_mask[:, :s].any()
    for g in rollout.group_ids.unique():
        rows = rollout.states[rollout.group_ids == g, : s + 1]
        assert torch.equal(rows, rows[:1].expand_as(rows))


def test_config_needs_same_noise_per_group(tmp_path):
    with pytest.raises(ValueError, match=r"shared_prefix=True: needs same_noise_per_group=True.*set "
                                         r"same_noise_per_group=True or shared_prefix=False"):
        FlowGRPOConfig(output_dir=str(tmp_path), shared_prefix=True)
    with pytest.raises(ValueError, match="DiffusionNFTConfig.same_noise_per_group"):  # its ODE sampler: one image
        trl_flow.DiffusionNFTConfig(output_dir=str(tmp_path), shared_prefix=True, same_noise_per_group=True)
    assert FlowGRPOConfig(output_dir=str(tmp_path), shared_prefix=True, same_noise_per_group=True).shared_prefix


@pytest.mark.parametrize("layout,mode", [("mixed", "window"), ("by_prompt", "random")])
def test_shapes_rollouts_match_off_within_rounding(tmp_path, layout, mode):
    """The shapes pipeline (CFG 3), 4 prompts x 4, 8 steps, two stochastic steps in [0, 5): six iterations' rollouts
    with the prefix shared against without, on the same weights."""
    from trl_flow.tasks import shapes
    from trl_flow.tasks.shapes import grammar, model

    config = FlowGRPOConfig(output_dir=str(tmp_path), height=32, width=32, max_steps=1, num_inference_steps=8,
                            num_generations=4, prompts_per_step=4, per_device_train_batch_size=8,
                            max_sequence_length=model.MAX_SEQUENCE_LENGTH,
                            guidance_scale=model.DEFAULT_GUIDANCE_SCALE, same_noise_per_group=True, shared_prefix=True,
                            sde_window_size=2, sde_window_range=5, sde_steps_mode=mode, batch_layout=layout,
                            disable_tqdm=True)
    trainer = FlowGRPOTrainer(config, model.load_base_pipeline(), [shapes.shapes_partial_reward],
                              train_dataset=grammar.train_prompts()["prompt"][:8])
    branches = []
    for step in range(6):
        off, on = _on_and_off(trainer, step)
        s = branch_step(on.extras["step_kinds"])
        branches.append(s)
        _check_prefix(on, s)
        assert float((off.states[:, -1] - on.states[:, -1]).abs().max()) <= TOLERANCE
        assert float((off.rewards - on.rewards).abs().max()) <= TOLERANCE
        assert float((off.states - on.states).abs().max()) <= TOLERANCE
        assert torch.equal(off.train_mask, on.train_mask)
    assert max(branches) >= 2  # the draws put the first stochastic step after a prefix of ODE steps


def test_prefix_rows_fall_by_g_minus_1_over_g_and_the_first_ratio_stays_1(tmp_path):
    """Training runs, on and off, 3 iterations with true CFG (2 rows per sample and call): the rollout's transformer
    rows drop by exactly s P (G - 1) 2 (s: the iteration's branch step), the update's are the same, the first
    ratio is exactly 1."""
    runs = {sp: _trainer(FlowGRPOTrainer, tmp_path / str(sp), guidance_scale=4.5, max_steps=3, shared_prefix=sp,
                         output_dir=str(tmp_path / f"out{sp}"), batch_layout="mixed")
            for sp in (False, True)}
    for t in runs.values():
        t.train()
    cfg = runs[True].config
    P, G, K = cfg.prompts_per_step, cfg.num_generations, cfg.num_inference_steps
    branches = [branch_step(runs[True]._step_kinds(step)) for step in range(3)]
    assert any(branches)
    for step, s in enumerate(branches):
        off, on = runs[False].state.log_history[step], runs[True].state.log_history[step]
        assert off["rows/rollout_transformer"] == P * G * K * 2  # every sample, every step, cond + uncond
        assert on["rows/rollout_transformer"] == (P * G * K - s * P * (G - 1)) * 2  # prefix: s P rows, not s P G
        assert on["rows/update_transformer"] == off["rows/update_transformer"] > 0
        assert on["ratio_first_max_dev"] == 0.0 and off["ratio_first_max_dev"] == 0.0
    assert abs(runs[True].state.log_history[0]["reward"] - runs[False].state.log_history[0]["reward"]) <= TOLERANCE


def _exported():
    from multiprocess_worker import trainer_classes

    return trainer_classes()


@pytest.mark.parametrize("cls", _exported(), ids=lambda c: c.__name__)
def test_every_trainer_shares_the_prefix(tmp_path, cls):
    """One iteration (branch step 2 of 6) on every trainer, on against off (the same initial weights): the rollout
    rows drop by s P (G - 1), the samples agree to rounding, the update's first ratio is exactly 1. DiffusionNFT
    (rollout_store='final') samples with flow_sde here (its default ODE sampler refuses same_noise_per_group:
    every sample of a group would be the same image). OP-GRPO refuses an SDE window (its replayed prefixes must
    keep their stochastic steps), so its first step is stochastic: nothing to share (unless a frozen expert's ODE
    steps come first), and its rollout is the one without."""
    op_grpo = cls.__name__ == "OPGRPOTrainer"
    runs = {}
    for sp in (False, True):
        runs[sp] = _trainer(cls, tmp_path / str(sp), sde_window_size=0 if op_grpo else 1, sde_window_range=4, seed=3,
                            shared_prefix=sp, output_dir=str(tmp_path / f"out{sp}"))
        runs[sp].train()
    cfg, on, off = runs[True].config, runs[True].last_rollout, runs[False].last_rollout
    s = branch_step(runs[True]._step_kinds(0))
    assert s == (0 if op_grpo else 2)
    assert float((on.states[:, -1] - off.states[:, -1]).abs().max()) <= (TOLERANCE if s else 0)
    assert float((on.rewards - off.rewards).abs().max()) <= (TOLERANCE if s else 0)
    if on.means is not None:
        _check_prefix(on, s)
    log_on, log_off = runs[True].state.log_history[0], runs[False].state.log_history[0]
    cut = log_off["rows/rollout_transformer"] - log_on["rows/rollout_transformer"]
    assert cut == s * cfg.prompts_per_step * (cfg.num_generations - 1)
    assert log_on.get("ratio_first_max_dev", 0.0) == 0.0


def test_editing_adapter_indexes_one_source_per_group(tmp_path, edit_dataset):
    """FLUX.1 Kontext (the source image is conditioning, one per group): shared prefix against not."""
    from trl_flow.models.flux_kontext import FluxKontextAdapter
    from trl_flow.testing import tiny_flux_kontext_pipeline

    adapter = FluxKontextAdapter(tiny_flux_kontext_pipeline(), source_size="source")
    trainer = _trainer(FlowGRPOTrainer, tmp_path, pipe=adapter, dataset=edit_dataset, num_generations=2,
                       prompts_per_step=4, guidance_scale=2.5, sde_window_size=1, sde_window_range=4, seed=3)
    off, on = _on_and_off(trainer, 0)
    s = branch_step(on.extras["step_kinds"])
    assert s == 2
    _check_prefix(on, s)
    assert float((off.states - on.states).abs().max()) <= TOLERANCE
    assert float((off.rewards - on.rewards).abs().max()) <= TOLERANCE


def test_samples_of_a_group_with_other_noise_are_refused(tmp_path):
    trainer = _trainer(FlowGRPOTrainer, tmp_path, sde_window_size=1, sde_window_range=4, seed=3)
    prompts, columns, group_ids = trainer.sample_prompts(0)
    noise = trainer.initial_noise(0)
    noise[1:] += 1  # no two rows share their noise any more
    with pytest.raises(ValueError, match="shared_prefix: the samples of a group do not share their initial noise"):
        trainer.sample(prompts, columns, group_ids, 0, noise=noise)
