"""What is particular to HunyuanVideo-1.5 (HunyuanVideo15Pipeline); the contract itself (parity, every trainer, the
LoRA round trip, bad sizes, recipe) is tests/test_models_conformance.py."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS

from trl_flow.models import get_adapter
from trl_flow.models.hunyuan_video15 import HunyuanVideo15Adapter
from trl_flow.rollout import sample_trajectories
from trl_flow.testing import tiny_hunyuan_video15_pipeline

H, W = 32, 48


def test_the_guiders_rescale_is_kept():
    """The pipeline guides through its guider: with guidance_rescale the rollout still equals pipe() bit for bit
    (the adapter combines the two passes with the guider, at the trainer's scale)."""
    pipe = tiny_hunyuan_video15_pipeline()
    pipe.guider = pipe.guider.new(guidance_scale=5.0, guidance_rescale=0.7)
    adapter = get_adapter(pipe, num_frames=5)
    expected = pipe(prompt=PROMPTS[:1], height=H, width=W, num_frames=5, num_inference_steps=3,
                    generator=torch.Generator().manual_seed(0), output_type="latent").frames
    with torch.no_grad():
        embeds = adapter.encode_prompts(PROMPTS[:1], True, None)
    noise = adapter.initial_noise(1, H, W, torch.Generator().manual_seed(0))
    traj = sample_trajectories(adapter, pipe.transformer, embeds, noise, adapter.schedule(3, H, W), ["ode"] * 3, 0.0,
                               5.0, batch_size=1)
    assert torch.equal(traj["states"][:, -1], expected)
    plain = adapter.velocity(pipe.transformer, noise, adapter.schedule(3, H, W).timesteps[0], embeds, 5.0)
    pipe.guider = pipe.guider.new(guidance_rescale=0.0)
    assert not torch.equal(plain, get_adapter(pipe, num_frames=5).velocity(
        pipe.transformer, noise, adapter.schedule(3, H, W).timesteps[0], embeds, 5.0))


def test_a_batch_decodes_as_its_videos_alone():
    """The VAE decodes one video at a time (diffusers 0.42.1's mid-block attention mask broadcasts wrongly for a
    batch): a batch's decode is each video's decode."""
    adapter = get_adapter(tiny_hunyuan_video15_pipeline(), num_frames=5)
    z = torch.randn((2, *adapter.latent_shape(H, W)), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        both = adapter.decode(z)
        alone = torch.cat([adapter.decode(z[i:i + 1]) for i in range(2)])
    assert both.shape == (2, 5, 3, H, W) and torch.equal(both, alone)


def test_refusals_name_the_fix(tmp_path):
    from diffusers import AdaptiveProjectedGuidance

    from trl_flow import FlowGRPOConfig, FlowGRPOTrainer

    pipe = tiny_hunyuan_video15_pipeline()
    pipe.guider = pipe.guider.new(start=0.2)
    with pytest.raises(ValueError, match="guides steps 0.2 to 1.0 of the schedule only"):
        get_adapter(pipe)
    pipe.guider = AdaptiveProjectedGuidance()
    with pytest.raises(ValueError, match="only ClassifierFreeGuidance"):
        get_adapter(pipe)
    pipe = tiny_hunyuan_video15_pipeline()
    pipe.transformer.register_to_config(use_meanflow=True)
    with pytest.raises(ValueError, match="MeanFlow transformer"):
        get_adapter(pipe)
    calls = []
    config = FlowGRPOConfig(output_dir=str(tmp_path), height=H, width=W, num_frames=5, guidance_scale=0.5,
                            num_inference_steps=2, num_generations=2, prompts_per_step=1,
                            per_device_train_batch_size=2, disable_tqdm=True)
    with pytest.raises(ValueError, match="guidance_scale=0.5: HunyuanVideo15Pipeline's guider guides at any scale"):
        FlowGRPOTrainer(config, tiny_hunyuan_video15_pipeline(), [lambda im, p, **c: calls.append(1) or [0.0]],
                        train_dataset=PROMPTS)
    assert calls == []
    assert type(get_adapter(tiny_hunyuan_video15_pipeline())) is HunyuanVideo15Adapter


def test_prompt_token_counts_are_the_pipelines():
    """The long-prompt warning counts what the pipeline's tokenizer keeps: the templated prompt after the 108-token
    crop, against its 1000-token limit."""
    adapter = get_adapter(tiny_hunyuan_video15_pipeline())
    assert adapter.prompt_token_limits(512) == {"tokenizer": 1000}
    prompts = ["a cat", "a cat and a dog in the rain"]
    with torch.no_grad():
        mask = adapter.encode_prompts(prompts, False)["prompt_embeds_mask"]
    assert adapter.prompt_token_counts(prompts, "tokenizer") == mask.sum(dim=1).int().tolist()
