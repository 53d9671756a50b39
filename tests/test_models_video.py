"""Video helpers (per_frame, frame strips, sample files) and the FLUX / Wan recipes."""

from __future__ import annotations

import math
import os

import pytest
import torch

from trl_flow.video import frame_strips, per_frame, save_videos


def videos(b=2, f=5, h=4, w=6, seed=0):
    return torch.rand(b, f, 3, h, w, generator=torch.Generator().manual_seed(seed))


def frame_mean(images, prompts, **columns):
    """Mean pixel of each image (N, 3, H, W)."""
    assert images.ndim == 4
    return images.mean(dim=(1, 2, 3))


@pytest.mark.parametrize("reduce", ["mean", "min", "max"])
def test_per_frame_reduces_frame_scores(reduce):
    v = videos()
    out = per_frame(frame_mean, reduce=reduce)(v, ["a", "b"])
    scores = v.mean(dim=(2, 3, 4)).double()  # (B, F)
    expected = {"mean": scores.mean(1), "min": scores.min(1).values, "max": scores.max(1).values}[reduce]
    assert out == pytest.approx(expected.tolist(), rel=1e-6)


def test_per_frame_passes_prompts_columns_stride_and_chunks():
    calls = []

    def reward(images, prompts, tag):
        calls.append((len(images), list(prompts), list(tag)))
        return [float(i) for i in range(len(images))]  # score = position in the call

    v = videos(b=2, f=5)
    reward.prepare = lambda device, dtype: calls.append(("prepare", device, dtype))
    wrapped = per_frame(reward, frame_stride=2, batch_size=4)
    assert wrapped.__name__ == "reward"  # logged under the image reward's name
    wrapped.prepare("cpu", torch.float32)  # the trainer's device/dtype hand-off reaches the image reward
    assert calls.pop() == ("prepare", "cpu", torch.float32)
    out = wrapped(v, ["a", "b"], tag=["x", "y"])
    # frames 0, 2, 4 of each video -> 6 frames, called in chunks of 4 and 2
    assert [c[0] for c in calls] == [4, 2]
    assert calls[0][1] == ["a", "a", "a", "b"] and calls[1][1] == ["b", "b"]
    assert calls[0][2] == ["x", "x", "x", "y"]
    assert out == pytest.approx([(0 + 1 + 2) / 3, (3 + 0 + 1) / 3])
    # an image batch goes straight through
    img = torch.rand(3, 3, 4, 4)
    assert per_frame(frame_mean)(img, ["a"] * 3).tolist() == pytest.approx(frame_mean(img, None).tolist())


def test_per_frame_skips_missing_frames():
    def reward(images, prompts):
        # video 0: frame 1 missing, video 1: all missing
        return [1.0, None, 3.0, None, float("nan"), None]

    out = per_frame(reward)(videos(b=2, f=3), ["a", "b"])
    assert out[0] == pytest.approx(2.0) and out[1] is None
    assert per_frame(reward, reduce="min")(videos(b=2, f=3), ["a", "b"])[0] == 1.0


def test_per_frame_bad_input():
    with pytest.raises(ValueError, match="reduce must be one of"):
        per_frame(frame_mean, reduce="median")
    with pytest.raises(ValueError, match="frame_stride"):
        per_frame(frame_mean, frame_stride=0)
    with pytest.raises(ValueError, match="returned 1 scores for 10 frames"):
        per_frame(lambda im, p: [0.0])(videos(), ["a", "b"])


def test_per_frame_video_reward_in_trainer_reward_contract():
    """A per_frame reward works through compute_rewards on a (B, F, 3, H, W) batch."""
    from trl_flow.rewards import compute_rewards, jpeg_incompressibility

    r = per_frame(jpeg_incompressibility)
    total, per_func = compute_rewards([r], ["jpeg_incompressibility"], [1.0], videos(b=3), ["a", "b", "c"], {})
    assert total.shape == (3,) and bool(torch.isfinite(total).all()) and bool((total > 0).all())


def test_frame_strips_and_sample_files(tmp_path):
    v = videos(b=2, f=9, h=8, w=8)
    strips = frame_strips(v, max_frames=4)
    assert strips.shape == (2, 3, 8, 4 * 8)
    # frames 0, 3, 5, 8 (evenly spaced, rounded) side by side
    for j, f in enumerate([0, 3, 5, 8]):
        assert torch.equal(strips[:, :, :, j * 8 : (j + 1) * 8], v[:, f])
    paths = save_videos(v, str(tmp_path), "grid.png", max_frames=4)
    assert paths[0] == os.path.join(str(tmp_path), "grid.png") and len(paths) == 3
    from PIL import Image

    assert Image.open(paths[0]).size == (32, 16)  # one strip per row
    if paths[1].endswith(".gif"):  # without imageio-ffmpeg
        assert Image.open(paths[1]).n_frames == 9
    with pytest.raises(ValueError, match="expected videos"):
        frame_strips(torch.rand(2, 3, 4, 4))


# ---------------------------------------------------------------------------------------------------- recipes
RECIPES = ["flux1_dev_flow_grpo.yaml", "wan21_t2v_1.3b_flow_grpo.yaml"]
SCRIPT_ARGS = {"trainer", "model_name_or_path", "dataset_name", "reward_funcs"}


def load_recipe(name):
    import yaml

    import trl_flow

    path = os.path.join(os.path.dirname(trl_flow.__file__), "recipes", name)
    with open(path) as f:
        return yaml.safe_load(f)


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_parses_into_config(name):
    from dataclasses import fields

    from trl_flow import FlowGRPOConfig

    recipe = load_recipe(name)
    names = {f.name for f in fields(FlowGRPOConfig)}
    unknown = set(recipe) - names - SCRIPT_ARGS
    assert not unknown, f"{name}: keys that are not FlowGRPOConfig fields: {unknown}"
    config = FlowGRPOConfig(**{k: v for k, v in recipe.items() if k in names})
    assert config.bf16
    if name.startswith("flux"):
        assert recipe["model_name_or_path"] == "black-forest-labs/FLUX.1-dev"
        assert (config.guidance_scale, config.num_inference_steps, config.height) == (3.5, 6, 512)
    else:
        assert recipe["model_name_or_path"] == "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
        assert (config.height, config.width, config.num_frames, config.num_inference_steps) == (240, 416, 33, 20)
        # the Wan adapter (same VAE factors and patch size as Wan2.1) accepts this resolution and frame count
        from trl_flow.models import WanAdapter
        from trl_flow.testing import tiny_wan_pipeline

        adapter = WanAdapter(tiny_wan_pipeline(scheduler="flow_match"))
        adapter.configure(config)
        assert config.height % adapter.resolution_multiple == 0 and config.width % adapter.resolution_multiple == 0
        assert adapter.latent_shape(config.height, config.width)[1:] == (9, 30, 52)
        assert math.prod(adapter.output_shape(config.height, config.width)) == 33 * 3 * 240 * 416
