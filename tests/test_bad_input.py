"""Invalid configs, datasets, rewards and pipelines fail early, with an error that names the culprit."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS, brightness, tiny_config

from trl_flow import FlowGRPOTrainer


# ---------------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    "overrides,field",
    [
        ({"num_generations": 1}, "num_generations"),
        ({"num_generations": 0}, "num_generations"),
        ({"sampler": "foo"}, "sampler"),
        ({"sampler": "ode"}, "sampler"),
        ({"noise_level": 0.0}, "noise_level"),
        ({"noise_level": float("nan")}, "noise_level"),
        ({"sampler": "cps", "noise_level": 1.5}, "noise_level"),
        ({"clip_range": 0.0}, "clip_range"),
        ({"clip_range": 1.0}, "clip_range"),
        ({"scale_rewards": "x"}, "scale_rewards"),
        ({"logprob_reduction": "max"}, "logprob_reduction"),
        ({"num_inference_steps": 4, "sde_window_size": 4}, "sde_window_size"),
        ({"num_inference_steps": 4, "sde_window_size": 9}, "sde_window_size"),
        ({"num_inference_steps": 6, "sde_window_size": 2, "sde_window_range": 5}, "sde_window_range"),
        ({"sde_window_size": -1}, "sde_window_size"),
        ({"num_inference_steps": 1}, "num_inference_steps"),
        ({"max_steps": 0}, "max_steps"),
        ({"per_device_train_batch_size": 0}, "per_device_train_batch_size"),
        ({"learning_rate": 0.0}, "learning_rate"),
        ({"learning_rate": -1e-3}, "learning_rate"),
        ({"beta": -0.1}, "beta"),
        ({"ema_decay": 1.0}, "ema_decay"),
        ({"finetune": "qlora"}, "finetune"),
        ({"optim": "sgd"}, "optim"),
        ({"bf16": True, "fp16": True}, "bf16"),
        ({"report_to": "nonsense"}, "report_to"),
        ({"reward_weights": [1.0, float("inf")]}, "reward_weights"),
        ({"save_total_limit": 0}, "save_total_limit"),
        ({"height": 0}, "height"),
    ],
)
def test_invalid_config_raises_value_error_naming_the_field(tmp_path, overrides, field):
    with pytest.raises(ValueError, match=field):
        tiny_config(tmp_path, **overrides)


def test_valid_edge_configs_are_accepted(tmp_path):
    tiny_config(tmp_path, num_generations=2, sampler="ddim", noise_level=1.0, num_inference_steps=6,
                sde_window_size=2, clip_range=1e-5, scale_rewards="none", beta=0.0, report_to="none")


def test_wrong_config_class_raises_type_error(tmp_path, fresh_pipe):
    from trl_flow import FlowRLConfig

    config = FlowRLConfig(output_dir=str(tmp_path / "out"), height=32, width=32)
    with pytest.raises(TypeError, match="FlowGRPOConfig"):
        FlowGRPOTrainer(config, fresh_pipe(), [brightness], train_dataset=PROMPTS)


# ---------------------------------------------------------------------------------------------------- data
def _new_trainer(tmp_path, pipe, rewards=(brightness,), train_dataset=PROMPTS, eval_dataset=None, **overrides):
    return FlowGRPOTrainer(tiny_config(tmp_path, **overrides), pipe, list(rewards), train_dataset=train_dataset,
                           eval_dataset=eval_dataset)


def test_dataset_without_prompt_column(tmp_path, fresh_pipe):
    from datasets import Dataset

    ds = Dataset.from_dict({"text": ["a cat", "a dog"]})
    with pytest.raises(ValueError, match="prompt") as info:
        _new_trainer(tmp_path, fresh_pipe(), train_dataset=ds)
    assert "train_dataset" in str(info.value) and "text" in str(info.value)  # names the columns it found
    with pytest.raises(ValueError, match="eval_dataset.*prompt"):
        _new_trainer(tmp_path, fresh_pipe(), eval_dataset=ds)


@pytest.mark.parametrize("dataset,exc,match", [
    (None, ValueError, "train_dataset"),
    ([], ValueError, "empty"),
    ({"prompt": [1, 2]}, ValueError, "prompt"),
    ([1, 2], TypeError, "train_dataset"),
    (42, TypeError, "train_dataset"),
])
def test_bad_train_datasets(tmp_path, fresh_pipe, dataset, exc, match):
    with pytest.raises(exc, match=match):
        _new_trainer(tmp_path, fresh_pipe(), train_dataset=dataset)


def test_dict_and_list_datasets_are_accepted_and_columns_reach_the_reward(tmp_path, fresh_pipe):
    seen = {}

    def reward(images, prompts, **columns):
        seen.update(columns)
        return [1.0] * len(prompts)

    trainer = _new_trainer(tmp_path, fresh_pipe(), rewards=[reward],
                           train_dataset={"prompt": ["a cat", "a dog"], "label": [0, 1]})
    assert trainer.train_dataset.column_names == ["prompt", "label"]
    assert seen == {"label": [0, 1]}  # the init check passes the other columns


# ---------------------------------------------------------------------------------------------------- rewards
class _CallCounter:
    def __init__(self, module):
        self.n = 0
        module.register_forward_hook(self)

    def __call__(self, *args):
        self.n += 1


def _wrong_length(images, prompts, **kwargs):
    return [0.0] * (len(prompts) + 1)


def _raising(images, prompts, **kwargs):
    raise ValueError("model server down")


def _non_numeric(images, prompts, **kwargs):
    return ["good"] * len(prompts)


@pytest.mark.parametrize("bad", [_wrong_length, _raising, _non_numeric])
def test_bad_reward_fails_in_the_constructor_naming_it(tmp_path, fresh_pipe, bad):
    pipe = fresh_pipe()
    calls = _CallCounter(pipe.transformer)
    with pytest.raises(RuntimeError, match=bad.__name__):
        _new_trainer(tmp_path, pipe, rewards=[brightness, bad])
    assert calls.n == 0  # before any sampling
    assert not getattr(pipe.transformer, "peft_config", None)  # and before the model was touched


def test_reward_checks(tmp_path, fresh_pipe):
    with pytest.raises(ValueError, match="reward_weights"):
        _new_trainer(tmp_path, fresh_pipe(), rewards=[brightness, brightness], reward_weights=[1.0])
    with pytest.raises(ValueError, match="reward_weights"):
        _new_trainer(tmp_path, fresh_pipe(), rewards=[brightness], reward_weights=[1.0, 2.0])
    with pytest.raises(TypeError, match="reward_funcs"):
        _new_trainer(tmp_path, fresh_pipe(), rewards=[brightness, "pickscore"])
    with pytest.raises(ValueError, match="reward_funcs"):
        _new_trainer(tmp_path, fresh_pipe(), rewards=[])


# ------------------------------------------------------------------------------------------ pipeline / sizes
@pytest.mark.parametrize("height,width,field", [(34, 32, "height"), (32, 30, "width"), (30, 30, "height")])
def test_size_not_divisible(tmp_path, fresh_pipe, height, width, field):
    with pytest.raises(ValueError, match=field) as info:
        _new_trainer(tmp_path, fresh_pipe(), height=height, width=width)
    assert "multiples of 4" in str(info.value)


def test_eval_steps_without_eval_dataset(tmp_path, fresh_pipe):
    with pytest.raises(ValueError, match="eval_steps.*eval_dataset"):
        _new_trainer(tmp_path, fresh_pipe(), eval_steps=2)
    trainer = _new_trainer(tmp_path, fresh_pipe())
    with pytest.raises(ValueError, match="eval_dataset"):
        trainer.evaluate()


def test_unsupported_pipeline(tmp_path):
    class NotAPipeline:
        pass

    with pytest.raises(TypeError, match="NotAPipeline"):
        _new_trainer(tmp_path, NotAPipeline())


def test_unknown_lora_target_modules(tmp_path, fresh_pipe):
    with pytest.raises(ValueError, match="nonexistent_proj"):
        _new_trainer(tmp_path, fresh_pipe(), lora_target_modules=["nonexistent_proj"])


def test_resume_from_missing_checkpoint(tmp_path, fresh_pipe):
    trainer = _new_trainer(tmp_path, fresh_pipe())
    with pytest.raises(ValueError, match="resume_from_checkpoint"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "nope"))
    assert trainer.state.global_step == 0
    # "latest" (= True) on a folder with no checkpoint yet is the always-resume job script's first run: a new run
    # (tests/test_reliability_cluster.py trains it), not an error
    from trl_flow.engine.checkpoints import nothing_to_resume

    assert nothing_to_resume("latest", trainer.config.output_dir)


def test_non_finite_loss_is_skipped_not_applied(tmp_path, fresh_pipe):
    """A NaN velocity (e.g. an overflow) must not reach the weights."""
    trainer = _new_trainer(tmp_path, fresh_pipe(), max_steps=1)
    rollout = trainer.make_rollout(0)
    trainer.compute_advantages(rollout)
    rollout.states[0, 1] = float("nan")  # poison one stored transition
    before = [p.detach().clone() for p in trainer.trainable_params]
    metrics = trainer.optimize(rollout, 0)
    assert metrics["nonfinite_skipped"] >= 1
    assert all(bool(torch.isfinite(p).all()) for p in trainer.trainable_params)
    # the second microbatch (samples 4..7, its own optimizer step) was clean and still trained
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.trainable_params))
