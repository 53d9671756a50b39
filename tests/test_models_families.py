"""What is particular to FLUX.1 and Wan2.1 (the shared checks, parity, every trainer, LoRA, bad sizes: rows "flux"
and "wan21" of test_models_conformance.py), and the helpers the family files share.

Tiny random FluxPipeline / WanPipeline (trl_flow.testing), 32 x 32 px, Wan videos of 5 or 9 frames.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from conftest import HEIGHT, MAX_SEQ, PROMPTS, WIDTH, velocity_and_input_grad

import trl_flow
from trl_flow.testing import tiny_flux_pipeline, tiny_sd3_pipeline, tiny_wan_pipeline

FAMILIES = ("flux", "wan")


def make_pipe(family, **kwargs):
    return tiny_flux_pipeline(**kwargs) if family == "flux" else tiny_wan_pipeline(**kwargs)


@pytest.fixture(autouse=True)
def _quiet_scheduler_swap(monkeypatch):
    """The Wan scheduler swap warns once per process; tests that check the warning reset the flag themselves."""
    import trl_flow.models.wan as wan

    monkeypatch.setattr(wan, "_SCHEDULER_SWAP_WARNED", True)


def exported_trainers():
    """Every trainer class trl_flow exports (FlowGRPOTrainer, OPGRPOTrainer, ...), with its config class."""
    out = []
    for name in trl_flow.__all__:
        obj = getattr(trl_flow, name)
        if inspect.isclass(obj) and issubclass(obj, trl_flow.FlowRLTrainer) and obj is not trl_flow.FlowRLTrainer:
            out.append(obj)
    return out


# ------------------------------------------------------------------------------------------- guidance
def test_flux_guidance_is_the_distilled_embedding():
    """FLUX's guidance_scale changes the velocity through the guidance embedding, with one transformer pass."""
    from trl_flow.models import FluxAdapter

    pipe = tiny_flux_pipeline()
    adapter = FluxAdapter(pipe)
    calls = []
    hook = pipe.transformer.register_forward_hook(lambda m, a, kw, o: calls.append(kw["guidance"]), with_kwargs=True)
    x = adapter.initial_noise(2, HEIGHT, WIDTH, torch.Generator().manual_seed(0))
    with torch.no_grad():
        embeds = adapter.encode_prompts(PROMPTS[:2], True, MAX_SEQ)
        assert set(embeds) == {"prompt_embeds", "pooled_prompt_embeds"}  # no negative prompt without true CFG
        t = adapter.schedule(4, HEIGHT, WIDTH).timesteps[1]
        v1 = adapter.velocity(pipe.transformer, x, t, embeds, 1.0)
        v35 = adapter.velocity(pipe.transformer, x, t, embeds, 3.5)
    hook.remove()
    assert len(calls) == 2 and calls[1].tolist() == [3.5, 3.5]
    assert not torch.allclose(v1, v35)
    with pytest.raises(ValueError, match="negative_prompt"):
        FluxAdapter(pipe, true_cfg_scale=2.0)


def test_wan_swaps_unipc_for_flow_matching_with_one_warning(monkeypatch):
    import trl_flow.models.wan as wan
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    from trl_flow.models import WanAdapter, get_adapter

    monkeypatch.setattr(wan, "_SCHEDULER_SWAP_WARNED", False)
    pipe = tiny_wan_pipeline()
    assert isinstance(pipe.scheduler, UniPCMultistepScheduler)
    with pytest.warns(UserWarning, match="FlowMatchEulerDiscreteScheduler"):
        adapter = get_adapter(pipe)
    assert isinstance(adapter, WanAdapter) and adapter.pipeline_tag == "text-to-video"
    assert isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler) and pipe.scheduler.config.shift == 3.0
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        get_adapter(tiny_wan_pipeline())  # once per process
        kept = tiny_wan_pipeline(scheduler="flow_match")
        sched = kept.scheduler
        get_adapter(kept)
        assert kept.scheduler is sched  # a flow-matching scheduler is left alone


@pytest.mark.parametrize("family", FAMILIES)
def test_detach_uncond_keeps_value_and_drops_uncond_gradient(family):
    """guidance_grad='cond_only': the guided velocity is the same; the gradient flows through the conditional pass
    only (FLUX with true CFG, Wan with CFG: two transformer passes)."""
    from trl_flow.models import FluxAdapter, WanAdapter

    pipe = make_pipe(family)
    adapter = (FluxAdapter(pipe, true_cfg_scale=3.0, negative_prompt="") if family == "flux"
               else WanAdapter(pipe, num_frames=5))
    with torch.no_grad():
        embeds = adapter.encode_prompts(PROMPTS[:2], True, MAX_SEQ)
    t = adapter.schedule(4, HEIGHT, WIDTH).timesteps[1]
    x0 = adapter.initial_noise(2, HEIGHT, WIDTH, torch.Generator().manual_seed(0))

    def value_and_grad(detach):
        return velocity_and_input_grad(adapter, pipe.transformer, x0, t, embeds, 3.0, detach)

    v_full, g_full = value_and_grad(False)
    v_cond, g_cond = value_and_grad(True)
    assert torch.equal(v_full, v_cond)
    assert not torch.allclose(g_full, g_cond)


# ---------------------------------------------------------------------------------------- every trainer
def video_or_image_brightness(images, prompts, **columns):
    return images.mean(dim=tuple(range(1, images.ndim)))


def family_config(config_class, tmp_path, family, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path / "out"), max_steps=2, num_generations=2, prompts_per_step=4,
        per_device_train_batch_size=4, height=HEIGHT, width=WIDTH, max_sequence_length=MAX_SEQ,
        num_inference_steps=3, eval_num_inference_steps=3, per_device_eval_batch_size=4,
        guidance_scale=3.5 if family == "flux" else 4.5, lora_r=4, lora_alpha=8, learning_rate=1e-2,
        clip_range=5e-2, beta=0.01, disable_tqdm=True, num_frames=5,
    )
    kwargs.update(overrides)
    return config_class(**kwargs)


def test_wan_video_rollout_stays_within_memory_estimate(tmp_path):
    """Everything a Wan rollout stores besides the prompt embeddings is the documented estimate (states, means,
    log-probs, mask, decoded videos) plus a few scalars per sample."""
    from trl_flow import FlowGRPOConfig, FlowGRPOTrainer

    config = family_config(FlowGRPOConfig, tmp_path, "wan", num_frames=9, num_inference_steps=4)
    trainer = FlowGRPOTrainer(config, make_pipe("wan"), [video_or_image_brightness], train_dataset=PROMPTS)
    rollout = trainer.make_rollout(0)
    trainer.compute_advantages(rollout)
    n, K = len(rollout), config.num_inference_steps
    estimate = trainer.adapter.rollout_bytes(n, K, HEIGHT, WIDTH)
    lat = 4 * 3 * (HEIGHT // 8) * (WIDTH // 8)
    assert estimate == n * (K + 1) * lat * 4 + n * K * lat * 4 + n * K * 5 + n * 9 * 3 * HEIGHT * WIDTH * 4

    def nbytes(x):
        if isinstance(x, torch.Tensor):
            return x.numel() * x.element_size()
        if isinstance(x, dict):
            return sum(nbytes(v) for v in x.values())
        return 0

    core = sum(nbytes(getattr(rollout, f)) for f in ("states", "means", "log_probs", "train_mask", "images"))
    assert core == estimate
    stored = sum(nbytes(v) for k, v in vars(rollout).items() if k != "embeds")
    assert estimate <= stored <= estimate + 64 * n  # rewards, advantages, group ids, stds: O(N + K)


# ------------------------------------------------------------------------------------------- bad input, loading
def test_unsupported_pipeline_lists_supported_ones():
    from diffusers import DiffusionPipeline

    from trl_flow.models import get_adapter

    class MyPipeline(DiffusionPipeline):
        pass

    with pytest.raises(TypeError, match="FluxPipeline.*StableDiffusion3Pipeline.*WanPipeline"):
        get_adapter(MyPipeline())


def test_trainer_accepts_configured_adapter(tmp_path):
    """A FluxAdapter with true CFG in place of the pipeline: two transformer passes per velocity."""
    from trl_flow import FlowGRPOConfig, FlowGRPOTrainer
    from trl_flow.models import FluxAdapter

    adapter = FluxAdapter(make_pipe("flux"), true_cfg_scale=2.0, negative_prompt="")
    config = family_config(FlowGRPOConfig, tmp_path, "flux", max_steps=1)
    trainer = FlowGRPOTrainer(config, adapter, [video_or_image_brightness], train_dataset=PROMPTS)
    assert trainer.adapter is adapter and trainer.pipe is adapter.pipe
    rollout = trainer.make_rollout(0)
    assert "negative_prompt_embeds" in rollout.embeds
    with pytest.raises(TypeError, match="set them on the adapter"):
        from trl_flow.models import get_adapter

        get_adapter(adapter, true_cfg_scale=3.0)


@pytest.mark.parametrize("family", FAMILIES)
def test_load_pipeline_round_trip(tmp_path, family):
    """A tiny pipeline saved with save_pretrained loads through load_pipeline (the real loading path)."""
    from trl_flow.models import FluxAdapter, WanAdapter, get_adapter, load_pipeline

    make_pipe(family).save_pretrained(tmp_path / "pipe")
    pipe = load_pipeline(str(tmp_path / "pipe"))
    assert type(get_adapter(pipe)) is (FluxAdapter if family == "flux" else WanAdapter)
    assert pipe.tokenizer_2 is not None if family == "flux" else pipe.tokenizer is not None


def test_load_pipeline_passes_the_dtype_without_a_deprecation_warning(tmp_path):
    """diffusers deprecates ``torch_dtype`` (a FutureWarning on every load): load_pipeline passes the keyword this
    diffusers documents, and the dtype still arrives."""
    import warnings

    import torch

    from trl_flow.models import load_pipeline
    from trl_flow.testing import tiny_sd3_pipeline

    tiny_sd3_pipeline().save_pretrained(tmp_path / "pipe")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe = load_pipeline(str(tmp_path / "pipe"), "bfloat16")
    assert [str(w.message) for w in caught if "torch_dtype" in str(w.message)] == []
    assert pipe.transformer.dtype == torch.bfloat16


@pytest.mark.parametrize("family", ["sd3", "flux"])
@pytest.mark.parametrize("field,value", [("experts", "high_noise"), ("guidance_scale_2", 3.0)])
def test_wan22_fields_are_refused_by_other_families(tmp_path, family, field, value):
    """`experts` / `guidance_scale_2` only mean something for Wan2.2-A14B: elsewhere they are refused, not ignored."""
    from trl_flow import FlowGRPOConfig, FlowGRPOTrainer

    calls = []

    def reward(images, prompts, **kw):
        calls.append(1)
        return images.mean(dim=tuple(range(1, images.ndim)))

    pipe = {"sd3": tiny_sd3_pipeline, "flux": tiny_flux_pipeline}[family]()
    config = FlowGRPOConfig(output_dir=str(tmp_path), max_steps=1, num_generations=2, prompts_per_step=1,
                            height=32, width=32, num_inference_steps=2, per_device_train_batch_size=2,
                            max_sequence_length=16, **{field: value})
    with pytest.raises(ValueError, match=f"{field}=.*does not read it"):
        FlowGRPOTrainer(config, pipe, [reward], train_dataset=["a cat"])
    assert calls == []
