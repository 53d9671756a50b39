"""The bad-input matrix: each case is a clear error before any compute, or a logged, counted skip."""

from __future__ import annotations

import logging
import os
import warnings

import pytest
import torch
from conftest import PROMPTS, brightness, tiny_config

from trl_flow import FlowGRPOTrainer
from trl_flow.rewards import RewardError


def _lora(trainer):
    return {n: p.detach().clone() for n, p in trainer.pipe.transformer.named_parameters() if "lora_" in n}


# ------------------------------------------------------------------------------------------------------ config
@pytest.mark.parametrize("overrides,field,why", [
    ({"lora_alpha": 0}, "lora_alpha", "never changes the model"),
    ({"adv_clip_max": 0.0}, "adv_clip_max", "nothing is trained"),
    ({"lora_dropout": 0.1}, "lora_dropout", "first ratio"),
    ({"guidance_scale": -1.0}, "guidance_scale", ">= 0"),
    ({"guidance_scale": float("nan")}, "guidance_scale", ">= 0"),
    ({"eval_guidance_scale": float("inf")}, "eval_guidance_scale", ">= 0"),
    ({"lr_scheduler_type": "reduce_lr_on_plateau"}, "lr_scheduler_type", "constant"),
    ({"offload": "sequential"}, "offload", "none"),
    ({"per_device_reward_batch_size": 0}, "per_device_reward_batch_size", ">= 1"),
])
def test_config_values_that_would_silently_train_nothing(tmp_path, overrides, field, why):
    with pytest.raises(ValueError, match=field) as info:
        tiny_config(tmp_path, **overrides)
    assert why in str(info.value)


def test_cli_refuses_prefix_abbreviations():
    import importlib.util
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("train_example", os.path.join(root, "examples", "train.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    with pytest.raises(ValueError, match="--num_gen"):  # not taken as --num_generations
        mod.main(["--num_gen", "3", "--model_name_or_path", "unused"])


# ------------------------------------------------------------------------------------------------------ data
@pytest.mark.parametrize("dataset,exc,match", [
    (["a cat", None], TypeError, "item 1 is None"),
    (["a cat", "  "], ValueError, "whitespace-only prompt.*row 1"),
    ({"prompt": ["", "a dog"]}, ValueError, "row 0"),
])
def test_bad_prompt_lists(tmp_path, fresh_pipe, dataset, exc, match):
    with pytest.raises(exc, match=match):
        FlowGRPOTrainer(tiny_config(tmp_path), fresh_pipe(), [brightness], train_dataset=dataset)


def test_dataset_dict_asks_for_a_split(tmp_path, fresh_pipe):
    from datasets import Dataset, DatasetDict

    dd = DatasetDict({"train": Dataset.from_dict({"prompt": PROMPTS}), "test": Dataset.from_dict({"prompt": PROMPTS})})
    with pytest.raises(TypeError, match=r"DatasetDict with splits \['train', 'test'\]; pick one split"):
        FlowGRPOTrainer(tiny_config(tmp_path), fresh_pipe(), [brightness], train_dataset=dd)


def test_long_prompts_warn_once_not_at_every_encode(make_trainer):
    long = "a very long prompt that the tiny sixteen token tokenizer has to truncate"
    tr = make_trainer(train_dataset=[long, "a cat"], max_steps=2)
    pipeline_log = []  # the pipeline's own truncation warning, which it repeats at every encode
    handler = logging.Handler()
    handler.emit = pipeline_log.append
    logging.getLogger(type(tr.pipe).__module__).addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            tr.train()
    finally:
        logging.getLogger(type(tr.pipe).__module__).removeHandler(handler)
    ours = [w for w in seen if "exceed the 16-token limit of pipe.tokenizer" in str(w.message)]
    assert len(ours) == 1 and "Reported once" in str(ours[0].message)
    assert not [r for r in pipeline_log if "was truncated" in r.getMessage()]


# ------------------------------------------------------------------------------------------------- pipeline
def test_pipeline_size_limit_is_named_before_compute(tmp_path, fresh_pipe):
    with pytest.raises(ValueError, match=r"height=256, width=256: .* at most 128 x 128.*--height/--width <= 128"):
        FlowGRPOTrainer(tiny_config(tmp_path, height=256, width=256), fresh_pipe(), [brightness],
                        train_dataset=PROMPTS)


def test_shapes_model_without_height_32(tmp_path):
    from trl_flow.tasks.shapes import load_base_pipeline

    pipe = load_base_pipeline()
    with pytest.warns(UserWarning, match=r"height=256 \(the model's: 32\)"), \
            pytest.raises(ValueError, match=r"height=256, width=256.*trained at 32 x 32.*e\.g\. 32"):
        FlowGRPOTrainer(tiny_config(tmp_path, height=256, width=256), pipe, [brightness], train_dataset=PROMPTS)
    # left at the dataclass default (512), the size is the one the model declares (trl_flow_defaults.json): 32
    trainer = FlowGRPOTrainer(tiny_config(tmp_path, height=512, width=512), pipe, [brightness],
                              train_dataset=PROMPTS)
    assert (trainer.config.height, trainer.config.width) == (32, 32)


def test_a_pipeline_given_to_a_trainer_before_is_refused(tmp_path, fresh_pipe):
    pipe = fresh_pipe()
    FlowGRPOTrainer(tiny_config(tmp_path), pipe, [brightness], train_dataset=PROMPTS)
    with pytest.raises(ValueError, match=r"already holds LoRA adapter\(s\) \['default'\].*fresh pipeline"):
        FlowGRPOTrainer(tiny_config(tmp_path), pipe, [brightness], train_dataset=PROMPTS)


def test_a_failed_build_leaves_the_pipeline_reusable(tmp_path, fresh_pipe, monkeypatch):
    import transformers

    pipe = fresh_pipe()
    with pytest.raises(ValueError, match="nonexistent_proj"):  # fails inside peft's add_adapter
        FlowGRPOTrainer(tiny_config(tmp_path, lora_target_modules=["nonexistent_proj"]), pipe, [brightness],
                        train_dataset=PROMPTS)

    def broken_scheduler(*args, **kwargs):
        raise RuntimeError("scheduler failed")

    monkeypatch.setattr(transformers, "get_scheduler", broken_scheduler)
    with pytest.raises(RuntimeError, match="scheduler failed"):  # fails after the adapter was added
        FlowGRPOTrainer(tiny_config(tmp_path), pipe, [brightness], train_dataset=PROMPTS)
    monkeypatch.undo()
    tr = FlowGRPOTrainer(tiny_config(tmp_path), pipe, [brightness], train_dataset=PROMPTS)
    assert list(tr.pipe.transformer.peft_config) == ["default"]


# ------------------------------------------------------------------------------------------------------ rewards
def test_no_reward_is_a_counted_skip_with_a_loud_warning(make_trainer):
    def none_reward(images, prompts, **kw):
        return [None] * len(prompts)

    def inf_reward(images, prompts, **kw):
        return [float("inf")] * len(prompts)

    tr = make_trainer(rewards=[none_reward, inf_reward], max_steps=3)
    before = _lora(tr)
    with pytest.warns(RuntimeWarning) as seen:
        tr.train()
    messages = [str(w.message) for w in seen]
    assert any("'inf_reward' returned inf for 8 of 8 images" in m for m in messages)
    assert any("no sample got a reward for 3 iterations in a row" in m for m in messages)
    assert [h["skipped_no_reward"] for h in tr.state.log_history] == [1.0, 2.0, 3.0]
    assert all(h["no_reward_frac"] == 1.0 for h in tr.state.log_history)
    assert all(torch.equal(before[n], p) for n, p in _lora(tr).items())


def test_a_reward_cannot_corrupt_the_images_of_the_next_reward_or_the_rollout(make_trainer):
    seen = {}

    def vandal(images, prompts, **columns):
        images.zero_()
        columns["label"].clear()
        return [0.0] * len(prompts)

    def observer(images, prompts, **columns):
        seen["mean"], seen["label"] = float(images.mean()), list(columns["label"])
        return brightness(images, prompts)

    tr = make_trainer(rewards=[vandal, observer], train_dataset={"prompt": PROMPTS, "label": [0, 1, 2, 3]},
                      max_steps=1)
    rollout = tr.make_rollout(0)
    assert seen["mean"] > 0.1 and len(seen["label"]) == len(rollout)
    assert float(rollout.images.mean()) == pytest.approx(seen["mean"])
    torch.testing.assert_close(rollout.rewards_per_func["observer"], brightness(rollout.images, None))


def test_a_reward_that_raises_mid_run_names_itself_and_the_iteration(make_trainer, tmp_path):
    calls = {"n": 0}

    def flaky(images, prompts, **kw):
        calls["n"] += 1
        if calls["n"] == 3:  # 1: the constructor's check, 2: iteration 1, 3: iteration 2
            raise ConnectionError("reward server down")
        return brightness(images, prompts)

    tr = make_trainer(rewards=[flaky], max_steps=3, save_steps=1)
    with pytest.raises(RewardError, match=r"iteration 2: reward function 'flaky' raised ConnectionError: reward "
                                          r"server down; the newest complete checkpoint is .*checkpoint-1"):
        tr.train()
    out = tmp_path / "out"
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == ["checkpoint-1"]
    assert tr.state.global_step == 1
