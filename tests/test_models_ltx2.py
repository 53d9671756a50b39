"""What is particular to LTX-2 (LTX2Pipeline: video and audio denoised together); the contract itself (video parity,
every trainer, the LoRA round trip, bad sizes, recipe) is tests/test_models_conformance.py."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS, velocity_and_input_grad

from trl_flow.models import get_adapter
from trl_flow.models.ltx2 import LTX2Adapter
from trl_flow.rollout import sample_trajectories
from trl_flow.testing import tiny_ltx2_pipeline

H, W, K = 32, 64, 3
OFF = dict(stg_scale=0.0, audio_stg_scale=0.0, modality_scale=1.0, audio_modality_scale=1.0, guidance_rescale=0.0,
           audio_guidance_rescale=0.0, audio_guidance_scale=1.0)


@pytest.mark.parametrize("options,guidance_scale,passes", [
    (OFF, 1.0, 1),  # every guidance off (Flow-Factory's training setting): one pass per step
    ({"spatio_temporal_guidance_blocks": [1]}, 3.0, 3),  # pipe()'s defaults: [negative, prompt], STG, isolation
    ({"spatio_temporal_guidance_blocks": [1], "stg_scale": 0.0, "audio_stg_scale": 0.0}, 1.0, 2),  # audio CFG only
], ids=["off", "defaults", "audio-cfg"])
def test_audio_is_sampled_with_the_video_as_the_pipeline_samples_it(options, guidance_scale, passes):
    """The state holds both latents: the rollout's audio latents and waveforms are exactly pipe()'s too, with each
    guidance configuration and the pipeline's number of transformer passes per step."""
    pipe = tiny_ltx2_pipeline()
    adapter = get_adapter(pipe, num_frames=5, frame_rate=25.0, **options)
    calls = []
    hook = pipe.transformer.register_forward_hook(lambda *a: calls.append(1))
    call = dict(prompt=PROMPTS[:1], height=H, width=W, num_frames=5, frame_rate=25.0, num_inference_steps=K,
                max_sequence_length=16, guidance_scale=guidance_scale, **options)
    latent = pipe(generator=torch.Generator().manual_seed(0), output_type="latent", **call)
    pixels = pipe(generator=torch.Generator().manual_seed(0), output_type="pt", **call)
    assert len(calls) == 2 * K * passes
    calls.clear()
    with torch.no_grad():
        embeds = adapter.encode_prompts(PROMPTS[:1], guidance_scale > 1, 16)
    noise = adapter.initial_noise(1, H, W, torch.Generator().manual_seed(0))
    traj = sample_trajectories(adapter, pipe.transformer, embeds, noise, adapter.schedule(K, H, W), ["ode"] * K, 0.0,
                               guidance_scale, batch_size=1)
    hook.remove()
    assert len(calls) == K * passes
    video, audio = adapter.pipe_latents(traj["states"][:, -1])
    assert torch.equal(video, latent.frames) and torch.equal(audio, latent.audio)
    with torch.no_grad():
        assert torch.equal(adapter.decode_audio(traj["states"][:, -1]), pixels.audio)
    v, a = adapter.split(traj["states"][:, -1], H, W)
    assert traj["states"].shape[-1] == v[0].numel() + a[0].numel() and a.numel() > 0  # the audio is in the state


def test_detach_uncond_keeps_the_value_and_drops_the_guidance_passes_gradient():
    adapter = LTX2Adapter(tiny_ltx2_pipeline(), num_frames=5, spatio_temporal_guidance_blocks=[1])
    with torch.no_grad():
        embeds = adapter.encode_prompts(PROMPTS[:2], True, 16)
    t = adapter.schedule(K, H, W).timesteps[1]
    x0 = adapter.initial_noise(2, H, W, torch.Generator().manual_seed(0))

    def value_and_grad(detach):
        return velocity_and_input_grad(adapter, adapter.transformer, x0, t, embeds, 3.0, detach)

    v_full, g_full = value_and_grad(False)
    v_cond, g_cond = value_and_grad(True)
    assert torch.equal(v_full, v_cond) and not torch.allclose(g_full, g_cond)


def test_bad_options_are_refused():
    pipe = tiny_ltx2_pipeline()
    with pytest.raises(ValueError, match=r"spatio_temporal_guidance_blocks=\[28\]: block indices of this 2-block"):
        LTX2Adapter(pipe)  # the pipeline's default block, for its 48-block transformer
    with pytest.raises(ValueError, match="stg_scale > 0 needs spatio_temporal_guidance_blocks"):
        LTX2Adapter(pipe, spatio_temporal_guidance_blocks=None)
    with pytest.raises(ValueError, match="audio_guidance_scale=-1.0: must be a finite number >= 0"):
        LTX2Adapter(pipe, audio_guidance_scale=-1.0, spatio_temporal_guidance_blocks=[1])
    with pytest.raises(ValueError, match="num_frames=4: LTX-2 needs 2k \\+ 1"):
        LTX2Adapter(pipe, num_frames=4, spatio_temporal_guidance_blocks=[1])
    assert type(LTX2Adapter(pipe, **OFF)) is LTX2Adapter  # no STG: no block needed
    pipe.vae.register_to_config(timestep_conditioning=True)
    with pytest.raises(ValueError, match="timestep_conditioning=True"):
        LTX2Adapter(pipe, **OFF)


def test_the_velocity_finds_its_sigma_in_any_schedule_built():
    """The x0-space guidance needs the step's scheduler sigma: a rollout's velocity is the same after another
    schedule (evaluation's step count, another size) was built in between; a size the adapter has no schedule for,
    or two sizes with states of one length, are refused naming the fix."""
    adapter = LTX2Adapter(tiny_ltx2_pipeline(), num_frames=5, **OFF)
    with torch.no_grad():
        embeds = adapter.encode_prompts(PROMPTS[:1], False, 16)
    x = adapter.initial_noise(1, H, W, torch.Generator().manual_seed(0))
    t = adapter.schedule(K, H, W).timesteps[1]
    with torch.no_grad():
        before = adapter.velocity(adapter.transformer, x, t, embeds, 1.0)
        adapter.schedule(7, H, W)
        adapter.schedule(K, 64, 64)
        assert torch.equal(adapter.velocity(adapter.transformer, x, t, embeds, 1.0), before)
        with pytest.raises(RuntimeError, match="come from no schedule: call schedule"):
            adapter.velocity(adapter.transformer, x[:, :-1], t, embeds, 1.0)
        adapter.schedule(K, W, H)  # 64 x 32: as many latents as 32 x 64
        with pytest.raises(RuntimeError, match=r"fit several sizes \(height, width\) \[\(32, 64\), \(64, 32\)\]"):
            adapter.velocity(adapter.transformer, x, t, embeds, 1.0)
    assert adapter.prompt_token_limits(16) == {"tokenizer": 16}
    assert adapter.prompt_token_counts([" a cat "], "tokenizer") == [len(adapter.pipe.tokenizer("a cat").input_ids)]
