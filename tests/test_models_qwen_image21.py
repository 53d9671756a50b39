"""What is particular to Qwen-Image 2.1 (QwenImage21Pipeline); the contract itself (parity for generation and
editing, every trainer, LoRA round trip, bad sizes, recipe) is tests/test_models_conformance.py."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import EDIT_PROMPTS, PROMPTS
from conftest import source_image as source

from trl_flow.models import cat_embeds, get_adapter, index_embeds
from trl_flow.models.qwen_image21 import QwenImage21Adapter
from trl_flow.rollout import sample_trajectories
from trl_flow.testing import tiny_qwen_image21_pipeline

H, W, MAX_SEQ = 32, 64, 64


def test_pipelines_kv_cache_agrees_with_the_recomputed_prefix():
    """pipe() caches the text and source keys / values after the first step; the adapter recomputes them (the LoRA
    changes them). Both agree here to float32 rounding (the conformance parity is with use_kv_cache=False)."""
    pipe = tiny_qwen_image21_pipeline()
    adapter = QwenImage21Adapter(pipe, conditions_on_source=True, output_resolution=32, output_size=(H, W))
    call = dict(prompt=["make it red"], image=source(0), height=H, width=W, num_inference_steps=4,
                output_resolution=32)
    cached = pipe(generator=torch.Generator().manual_seed(0), output_type="latent", **call).images
    noise = adapter.initial_noise(1, H, W, torch.Generator().manual_seed(0))
    with torch.no_grad():
        embeds = adapter.encode_prompts(["make it red"], False, MAX_SEQ, images=[source(0)])
    traj = sample_trajectories(adapter, pipe.transformer, embeds, noise, adapter.schedule(4, H, W), ["ode"] * 4, 0.0,
                               1.0, batch_size=1)
    torch.testing.assert_close(adapter.pack(traj["states"][:, -1]), cached, rtol=0, atol=1e-5)


def test_configured_sample_sigmas_are_the_schedule():
    """A pipeline with sample_sigmas in its config samples them (their count is the number of steps): the adapter's
    schedule is the same, the rollout equals pipe(), and another num_inference_steps is refused, naming the fix."""
    sigmas = [1.0, 0.8, 0.45, 0.2]
    pipe = tiny_qwen_image21_pipeline(sample_sigmas=sigmas)
    adapter = get_adapter(pipe)
    call = dict(prompt=PROMPTS[:2], height=H, width=W, num_inference_steps=4, use_kv_cache=False)
    expected = pipe(generator=torch.Generator().manual_seed(1), output_type="latent", **call).images
    schedule = adapter.schedule(4, H, W)
    assert torch.equal(schedule.sigmas, pipe.scheduler.sigmas.float())
    with torch.no_grad():
        embeds = adapter.encode_prompts(PROMPTS[:2], False, MAX_SEQ)
    noise = adapter.initial_noise(2, H, W, torch.Generator().manual_seed(1))
    traj = sample_trajectories(adapter, pipe.transformer, embeds, noise, schedule, ["ode"] * 4, 0.0, 1.0,
                               batch_size=2)
    assert torch.equal(adapter.pack(traj["states"][:, -1]), expected)
    linear = get_adapter(tiny_qwen_image21_pipeline()).schedule(4, H, W)
    assert not torch.equal(schedule.sigmas, linear.sigmas)
    with pytest.raises(ValueError, match="num_inference_steps=6: this QwenImage21Pipeline samples its configured "
                                         "sample_sigmas, 4 steps"):
        adapter.schedule(6, H, W)


def _config(tmp_path, **overrides):
    from trl_flow import FlowGRPOConfig

    kwargs = dict(output_dir=str(tmp_path / "out"), height=32, width=32, max_sequence_length=MAX_SEQ,
                  num_inference_steps=2, num_generations=2, prompts_per_step=1, per_device_train_batch_size=2,
                  disable_tqdm=True)
    kwargs.update(overrides)
    return FlowGRPOConfig(**kwargs)


def _edit_dataset(tmp_path, n=2):
    from datasets import Dataset

    paths = []
    for i in range(n):
        paths.append(str(tmp_path / f"src{i}.png"))
        source(i).save(paths[-1])
    return Dataset.from_dict({"prompt": EDIT_PROMPTS[:n], "source_image": paths})


def test_the_train_dataset_chooses_generation_or_editing(tmp_path):
    """Given the pipeline, a trainer generates on a text dataset and edits on one with sources; a fixed mode or an
    eval dataset that disagrees is refused before any compute, naming the fix."""
    from trl_flow import FlowGRPOTrainer

    calls = []

    def reward(images, prompts, **columns):
        calls.append(1)
        return images.mean(dim=(1, 2, 3))

    text = FlowGRPOTrainer(_config(tmp_path), tiny_qwen_image21_pipeline(), [reward], train_dataset=PROMPTS)
    assert text.adapter.conditioning == "text" and text.adapter.pipeline_tag == "text-to-image"
    edit = FlowGRPOTrainer(_config(tmp_path, source_image_size="output"), tiny_qwen_image21_pipeline(), [reward],
                           train_dataset=_edit_dataset(tmp_path))
    assert edit.adapter.conditioning == "text_and_image" and edit.adapter.source_size == "output"
    assert edit.adapter.pipeline_tag == "image-to-image"
    calls.clear()
    cases = [
        (dict(eval_dataset=PROMPTS, train_dataset=_edit_dataset(tmp_path)),
         "eval_dataset: has no `source_image` column but train_dataset does"),
        (dict(train_dataset=PROMPTS, config=dict(source_image_size="output")),
         "source_image_size='output': applies to editing, but train_dataset has no `source_image` column"),
    ]
    for kwargs, match in cases:
        config = _config(tmp_path, eval_steps=0, **kwargs.pop("config", {}))
        with pytest.raises(ValueError, match=match):
            FlowGRPOTrainer(config, tiny_qwen_image21_pipeline(), [reward], **kwargs)
    for fixed, dataset, match in ((False, _edit_dataset(tmp_path), "has a `source_image` column, but "
                                   "QwenImage21Adapter generates from text"),
                                  (True, PROMPTS, "train_dataset: no `source_image` column")):
        adapter = QwenImage21Adapter(tiny_qwen_image21_pipeline(), conditions_on_source=fixed)
        with pytest.raises(ValueError, match=match):
            FlowGRPOTrainer(_config(tmp_path), adapter, [reward], train_dataset=dataset)
    assert calls == []


def test_edit_conditioning_does_not_depend_on_the_batch():
    """Editing: a sample encoded alone equals its row of a batch bit for bit (the text encoder's positions follow
    a batch's padding, so each sample is encoded alone), rows index and concatenate, a repeated (prompt, source)
    pair is encoded once, and the source conditions the velocity."""
    adapter = QwenImage21Adapter(tiny_qwen_image21_pipeline(), conditions_on_source=True, source_size="output",
                                 output_size=(H, W))
    srcs = [source(0), source(1)]
    calls = []
    hook = adapter.pipe.text_encoder.register_forward_hook(lambda *a: calls.append(1))
    with torch.no_grad():
        both = adapter.encode_prompts(EDIT_PROMPTS[:2] + EDIT_PROMPTS[:1], True, MAX_SEQ, images=srcs + srcs[:1])
        assert len(calls) == 2 * 2  # two distinct pairs, conditional and negative
        one = adapter.encode_prompts(EDIT_PROMPTS[1:2], True, MAX_SEQ, images=srcs[1:])
    hook.remove()
    assert both["image_latents"].shape == (3, 8, 2, 2)  # a square source at 32 x 64 px's area: 32 x 32 px
    assert bool(both["prompt_embeds_image_pad_mask"].any(dim=1).all())  # the source's vision slots are marked
    for k in both:
        assert torch.equal(index_embeds(both, [1])[k], one[k]), k
        assert torch.equal(cat_embeds([index_embeds(both, [0]), one])[k], both[k][:2]), k
    two = index_embeds(both, [0, 1])
    x = adapter.initial_noise(1, H, W, torch.Generator().manual_seed(0)).repeat(2, 1, 1, 1)
    t = adapter.schedule(3, H, W).timesteps[1]
    swapped = dict(two, image_latents=two["image_latents"].flip(0))
    with torch.no_grad():
        v, v_swapped = (adapter.velocity(adapter.transformer, x, t, e, 1.0) for e in (two, swapped))
    assert not torch.allclose(v, v_swapped)


def test_a_prompt_over_max_sequence_length_is_cut_with_one_warning():
    adapter = get_adapter(tiny_qwen_image21_pipeline())
    with pytest.warns(UserWarning, match="more than max_sequence_length=16; QwenImage21Pipeline does not cut"):
        with torch.no_grad():
            embeds = adapter.encode_prompts(["a long prompt " * 4], False, 16)
    assert embeds["prompt_embeds"].shape[1] == 16
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            adapter.encode_prompts(["another long prompt " * 4], False, 16)


def test_bad_options_are_refused():
    pipe = tiny_qwen_image21_pipeline()
    with pytest.raises(ValueError, match="source_size='output': only for editing"):
        QwenImage21Adapter(pipe, conditions_on_source=False, source_size="output")
    with pytest.raises(ValueError, match="output_resolution=16: an int >= 32"):
        QwenImage21Adapter(pipe, output_resolution=16)
    with pytest.raises(ValueError, match="images= given to a generation adapter"):
        get_adapter(pipe).encode_prompts(["a cat"], False, MAX_SEQ, images=[source(0)])
    with pytest.raises(ValueError, match="needs images= with one source image per prompt"):
        QwenImage21Adapter(pipe, conditions_on_source=True).encode_prompts(["a cat"], False, MAX_SEQ)
