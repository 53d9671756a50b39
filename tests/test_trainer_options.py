"""Trainer options beyond the default LoRA/fp32 path: full fine-tuning, bf16, trackers, evaluation, sample grids,
gradient checkpointing, 8-bit Adam config, and Ctrl-C."""

from __future__ import annotations

import glob
import os

import pytest
import torch

from conftest import PROMPTS, brightness


def _lora(trainer):
    return {n: p.detach().clone() for n, p in trainer.pipe.transformer.named_parameters() if "lora_" in n}


def test_full_finetune_trains_base_weights_keeps_a_frozen_reference_and_saves_a_pipeline(make_trainer, tmp_path):
    tr = make_trainer(finetune="full", beta=0.04, max_steps=2, learning_rate=1e-3)
    before = {n: p.detach().clone() for n, p in tr.pipe.transformer.named_parameters()}
    vae_before = {n: p.detach().clone() for n, p in tr.pipe.vae.named_parameters()}
    ref_before = {n: p.detach().clone() for n, p in tr.ref_model.named_parameters()}
    tr.train()
    changed = [n for n, p in tr.pipe.transformer.named_parameters() if not torch.equal(p, before[n])]
    assert len(changed) > 10 and not any("lora_" in n for n in changed)
    assert all(torch.equal(p, vae_before[n]) for n, p in tr.pipe.vae.named_parameters())
    assert all(torch.equal(p, ref_before[n]) for n, p in tr.ref_model.named_parameters())
    assert tr.state.log_history[-1]["kl"] > 0  # the policy moved away from the frozen reference
    out = tr.save_model(str(tmp_path / "full"))
    from trl_flow.models import load_pipeline

    pipe = load_pipeline(out)
    for n, p in pipe.transformer.named_parameters():
        assert torch.equal(p, dict(tr.pipe.transformer.named_parameters())[n])


@pytest.fixture
def fresh_accelerate_state():
    """accelerate keeps one AcceleratorState per process and refuses a second mixed-precision setting."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def test_bf16_keeps_lora_weights_and_kernel_math_in_float32(make_trainer, fresh_accelerate_state):
    tr = make_trainer(bf16=True, max_steps=2, learning_rate=1e-2)
    assert tr.pipe.vae.dtype == torch.bfloat16 and tr.pipe.text_encoder.dtype == torch.bfloat16
    lora = [p for n, p in tr.pipe.transformer.named_parameters() if "lora_" in n]
    base = [p for n, p in tr.pipe.transformer.named_parameters() if "lora_" not in n]
    assert all(p.dtype == torch.float32 for p in lora) and all(p.dtype == torch.bfloat16 for p in base)
    before = _lora(tr)
    tr.train()
    rollout = tr.last_rollout
    assert rollout.states.dtype == torch.float32 and rollout.log_probs.dtype == torch.float32
    assert all(h["ratio_first_max_dev"] == 0.0 for h in tr.state.log_history)
    after = _lora(tr)
    assert all(torch.isfinite(v).all() for v in after.values())
    assert any(not torch.equal(after[n], before[n]) for n in after)


def test_tensorboard_tracker_eval_and_sample_grids(make_trainer, tmp_path):
    pytest.importorskip("tensorboard")
    out = tmp_path / "tb"
    tr = make_trainer(output_dir=str(out), report_to="tensorboard", run_name="tb_run", max_steps=2, eval_steps=1,
                      log_images_steps=1, eval_dataset=PROMPTS[:2])
    tr.train()
    assert glob.glob(str(out / "tb_run" / "**" / "events.out.tfevents*"), recursive=True)
    evals = [h for h in tr.state.log_history if "eval/reward" in h]
    assert [h["step"] for h in evals] == [0, 1, 2]
    assert all(0 <= h["eval/brightness"] <= 1 for h in evals)
    for name in ("eval_step_0.png", "eval_step_2.png", "train_step_1.png", "train_step_2.png"):
        assert os.path.getsize(out / "samples" / name) > 0
    lines = (out / "log_history.jsonl").read_text().splitlines()
    assert len(lines) == len(tr.state.log_history)


def test_gradient_checkpointing_gives_the_same_update(make_trainer, tmp_path):
    a = make_trainer(output_dir=str(tmp_path / "a"), max_steps=1)
    b = make_trainer(output_dir=str(tmp_path / "b"), max_steps=1, gradient_checkpointing=True)
    a.train()
    b.train()
    la, lb = _lora(a), _lora(b)
    assert all(torch.allclose(la[n], lb[n], atol=1e-6) for n in la)


def test_ctrl_c_saves_the_last_complete_iteration(make_trainer, tmp_path):
    import signal

    calls = {"n": 0}

    def interrupting(images, prompts, **kw):
        calls["n"] += 1
        if calls["n"] == 3:  # 1: the constructor's check, 2: iteration 1, 3: iteration 2 (mid-iteration)
            os.kill(os.getpid(), signal.SIGINT)
        return brightness(images, prompts)

    out = tmp_path / "int"
    tr = make_trainer(rewards=[interrupting], output_dir=str(out), max_steps=4)
    with pytest.raises(KeyboardInterrupt):
        tr.train()
    assert tr.state.global_step == 2  # iteration 2 was finished, then saved; iteration 3 never started
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == ["checkpoint-2"]
    resumed = make_trainer(output_dir=str(out), max_steps=3)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 3
    assert [h["step"] for h in resumed.state.log_history] == [1, 2, 3]


def test_adamw_8bit_is_selectable():
    from trl_flow import FlowGRPOConfig

    assert FlowGRPOConfig(optim="adamw_8bit").optim == "adamw_8bit"
    with pytest.raises(ValueError, match="optim"):
        FlowGRPOConfig(optim="sgd")
