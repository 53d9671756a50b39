"""``eval_height`` / ``eval_width``: evaluation and ``generate()`` at their own size, checked at construction."""

from __future__ import annotations

import pytest


def test_evaluate_samples_at_the_eval_size(make_trainer):
    trainer = make_trainer(eval_dataset=["a cat", "a red dog"], eval_height=48, eval_width=40)
    metrics = trainer.evaluate()
    assert trainer.last_eval_images.shape == (2, 3, 48, 40) and "eval/reward" in metrics
    images, latents = trainer.generate(["a cat"])
    assert images.shape == (1, 3, 48, 40)
    rollout = trainer.make_rollout(0)  # training keeps height x width
    assert rollout.images.shape[-2:] == (32, 32)


def test_default_eval_size_is_the_training_size(make_trainer):
    trainer = make_trainer(eval_dataset=["a cat"])
    assert trainer.eval_size == (32, 32)
    trainer.evaluate()
    assert trainer.last_eval_images.shape == (1, 3, 32, 32)


def test_bad_eval_size_is_refused_before_compute(make_trainer):
    with pytest.raises(ValueError, match="eval_height=34, eval_width=32: must be multiples of 4"):
        make_trainer(eval_height=34)
    with pytest.raises(ValueError, match="eval_width=0: must be an integer >= 1"):
        make_trainer(eval_width=0)


def test_editing_pipeline_refuses_another_eval_size(make_trainer, edit_dataset):
    from trl_flow.testing.flux_kontext import tiny_flux_kontext_pipeline

    with pytest.raises(ValueError, match="eval_height=64, eval_width=None: .*source-image conditioning"):
        make_trainer(pipe=tiny_flux_kontext_pipeline(), train_dataset=edit_dataset, eval_height=64)
