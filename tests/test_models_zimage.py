"""What is particular to Z-Image (ZImagePipeline, ZImageAdapter): embeddings, timesteps, CFG options, detach_uncond,
the turbo setting, loading, RoPE limits, the recipe. Parity (no guidance as Z-Image-Turbo samples, CFG, CFG with the
pipeline's normalisation and truncation), every trainer, the LoRA round trip, resume with EMA, bad sizes: row
"zimage" of test_models_conformance.py.

Tiny random ZImagePipeline (trl_flow.testing.tiny_zimage_pipeline), 32 x 32 px: latents (4, 16, 16), 64 image
tokens; prompts of 24 to 50 tokens after Qwen3's chat template (so the transformer's batch is padded and masked).
"""

from __future__ import annotations

import pytest
import torch
from conftest import HEIGHT, PROMPTS, WIDTH, velocity_and_input_grad
from test_models_families import family_config, video_or_image_brightness

from trl_flow.models import get_adapter
from trl_flow.models.zimage import ZImageAdapter
from trl_flow.testing import tiny_zimage_pipeline

MAX_SEQ = 48  # the chat template alone takes 19 byte-level tokens
LONG_PROMPTS = ["a cat", "a red dog with a hat", "a blue car", "green sky over a very long road"]


def zimage_config(config_class, tmp_path, **overrides):
    overrides.setdefault("guidance_scale", 2.0)  # CFG: two branches in one transformer call
    overrides.setdefault("max_sequence_length", MAX_SEQ)
    return family_config(config_class, tmp_path, "zimage", **overrides)


def lora_params(trainer):
    return {n: p.detach().clone() for n, p in trainer.pipe.transformer.named_parameters() if "lora_" in n}


# ----------------------------------------------------------------------------------- encoding, guidance
PARITY = [
    # (guidance_scale, adapter options)
    (0.0, {}),  # Z-Image-Turbo: one pass per step
    (2.0, {}),  # CFG with the default empty negative prompt
    (2.0, {"negative_prompt": "ugly", "cfg_normalization": 1.0, "cfg_truncation": 0.5}),
]


def _pipe_call(pipe, prompts, guidance_scale, options, output_type, K=4):
    kwargs = {k: v for k, v in options.items() if k != "negative_prompt"}
    if "negative_prompt" in options:  # a fresh list: the pipeline templates its prompt lists in place
        kwargs["negative_prompt"] = [options["negative_prompt"]] * len(prompts)
    return pipe(list(prompts), height=HEIGHT, width=WIDTH, num_inference_steps=K, guidance_scale=guidance_scale,
                max_sequence_length=MAX_SEQ, generator=torch.Generator().manual_seed(3), output_type=output_type,
                **kwargs).images


def test_embeddings_are_the_pipelines_list():
    """Unpadding the stored (B, L, D) embeddings with their mask gives exactly pipe.encode_prompt's per-prompt
    list (cond and negative)."""
    pipe = tiny_zimage_pipeline()
    adapter = ZImageAdapter(pipe, negative_prompt="blurry")
    with torch.no_grad():
        ours = adapter.encode_prompts(LONG_PROMPTS, True, MAX_SEQ)
        pe, npe = pipe.encode_prompt(list(LONG_PROMPTS), do_classifier_free_guidance=True,
                                     negative_prompt=["blurry"] * 4, max_sequence_length=MAX_SEQ)
    lengths = ours["prompt_mask"].sum(1).tolist()
    assert ours["prompt_embeds"].shape[:2] == (4, MAX_SEQ) and len(set(lengths[:3])) == 3  # padded + masked
    lists = adapter.pipeline_embeds(ours)
    for got, want in ((lists["prompt_embeds"], pe), (lists["negative_prompt_embeds"], npe)):
        assert [g.shape for g in got] == [w.shape for w in want] and all(map(torch.equal, got, want))


def test_timesteps_are_inverted_and_the_prediction_negated():
    """The transformer gets (1000 - t) / 1000 = 1 - sigma (0 at pure noise); the velocity is minus its output."""
    pipe = tiny_zimage_pipeline()
    adapter = ZImageAdapter(pipe)
    seen = []
    hook = pipe.transformer.register_forward_hook(lambda m, a, kw, o: seen.append((kw["t"], o[0])), with_kwargs=True)
    schedule = adapter.schedule(4, HEIGHT, WIDTH)
    x = adapter.initial_noise(2, HEIGHT, WIDTH, torch.Generator().manual_seed(0))
    with torch.no_grad():
        embeds = adapter.encode_prompts(PROMPTS[:2], False, MAX_SEQ)
        v = adapter.velocity(pipe.transformer, x, schedule.timesteps[0], embeds, 0.0)
    hook.remove()
    (t, out), = seen
    assert t.tolist() == [0.0, 0.0] and float(schedule.sigmas[0]) == 1.0
    assert torch.equal(v, -torch.stack(out).squeeze(2))


def test_cfg_options_act_and_guidance_in_zero_one_still_guides(tmp_path):
    """cfg_normalization and cfg_truncation change the velocity where they apply; Z-Image guides for any scale > 0
    (the trainer's guidance_scale=0.5 encodes the negative prompt); velocity without negative embeddings and a
    scale > 0 is refused."""
    from trl_flow import FlowGRPOConfig

    pipe = tiny_zimage_pipeline()
    plain, normed = ZImageAdapter(pipe), ZImageAdapter(pipe, cfg_normalization=1.0)
    truncated = ZImageAdapter(pipe, cfg_truncation=0.3)
    schedule = plain.schedule(4, HEIGHT, WIDTH)
    x = plain.initial_noise(2, HEIGHT, WIDTH, torch.Generator().manual_seed(0))
    with torch.no_grad():
        embeds = plain.encode_prompts(PROMPTS[:2], True, MAX_SEQ)
        early, late = schedule.timesteps[0], schedule.timesteps[-1]  # 1 - sigma: 0 and > 0.3

        def v(adapter, t, g=3.0):
            return adapter.velocity(pipe.transformer, x, t, embeds, g)

        assert not torch.equal(v(plain, early), v(plain, early, 0.0))
        assert not torch.equal(v(normed, early), v(plain, early))
        assert torch.equal(v(truncated, early), v(plain, early))  # 1 - sigma = 0 <= 0.3: guided
        assert torch.equal(v(truncated, late), v(plain, late, 0.0))  # truncated: the conditional pass alone
        per_sample = torch.stack([early, late])  # (B,) timesteps: each sample its own decision
        mixed = truncated.velocity(pipe.transformer, x, per_sample, embeds, 3.0)
        assert torch.equal(mixed[0], v(plain, early)[0])
        # the conditional pass alone, computed in a call of 4 items instead of 2 (float rounding may differ)
        torch.testing.assert_close(mixed[1], v(plain, late, 0.0)[1], rtol=0, atol=1e-5)
        assert not torch.allclose(mixed[1], v(plain, late)[1], atol=1e-3)
        with pytest.raises(ValueError, match="guides for any guidance_scale > 0"):
            plain.velocity(pipe.transformer, x, early, {k: embeds[k] for k in ("prompt_embeds", "prompt_mask")}, 0.5)
    adapter = ZImageAdapter(pipe)
    adapter.configure(zimage_config(FlowGRPOConfig, tmp_path, guidance_scale=0.5))
    with torch.no_grad():
        assert "negative_prompt_embeds" in adapter.encode_prompts(PROMPTS[:1], False, MAX_SEQ)
    with pytest.raises(ValueError, match="cfg_normalization"):
        ZImageAdapter(pipe, cfg_normalization=-1.0)


def test_detach_uncond_keeps_value_and_drops_uncond_gradient():
    adapter = ZImageAdapter(tiny_zimage_pipeline())
    with torch.no_grad():
        embeds = adapter.encode_prompts(PROMPTS[:2], True, MAX_SEQ)
    t = adapter.schedule(4, HEIGHT, WIDTH).timesteps[1]
    x0 = adapter.initial_noise(2, HEIGHT, WIDTH, torch.Generator().manual_seed(0))

    def value_and_grad(detach):
        return velocity_and_input_grad(adapter, adapter.transformer, x0, t, embeds, 3.0, detach)

    v_full, g_full = value_and_grad(False)
    v_cond, g_cond = value_and_grad(True)
    assert torch.equal(v_full, v_cond)
    assert not torch.allclose(g_full, g_cond)


# --------------------------------------------------------------------------------------------- training
def test_turbo_setting_trains_with_one_pass_per_step(tmp_path):
    """guidance_scale=0 (Z-Image-Turbo): no negative prompt is encoded, one transformer call per velocity."""
    from trl_flow import FlowGRPOConfig, FlowGRPOTrainer

    config = zimage_config(FlowGRPOConfig, tmp_path, guidance_scale=0.0, max_steps=1)
    trainer = FlowGRPOTrainer(config, tiny_zimage_pipeline(), [video_or_image_brightness], train_dataset=PROMPTS)
    rollout = trainer.make_rollout(0)
    assert set(rollout.embeds) == {"prompt_embeds", "prompt_mask"}
    before = lora_params(trainer)
    state = trainer.train()
    assert state.log_history[0]["ratio_first_max_dev"] == 0.0
    assert any(not torch.equal(before[n], p) for n, p in lora_params(trainer).items())


# ------------------------------------------------------------------------------------------- loading, bad input
def test_load_pipeline_round_trip(tmp_path):
    """A tiny pipeline saved with save_pretrained loads through load_pipeline (tokenizer and chat template
    included) and samples exactly as before."""
    from trl_flow.models import load_pipeline

    pipe = tiny_zimage_pipeline()
    pipe.save_pretrained(tmp_path / "pipe")
    loaded = load_pipeline(str(tmp_path / "pipe"))
    assert type(get_adapter(loaded)) is ZImageAdapter
    assert loaded.tokenizer.chat_template == pipe.tokenizer.chat_template
    for p in (pipe, loaded):
        p.set_progress_bar_config(disable=True)
    expected = _pipe_call(pipe, PROMPTS[:2], 2.0, {}, "latent")
    assert torch.equal(_pipe_call(loaded, PROMPTS[:2], 2.0, {}, "latent"), expected)


def test_rope_limits_are_the_real_ones():
    """The limits check_size / configure enforce are where the transformer really fails: one patch row less
    works, the first one past it raises in the RoPE lookup."""
    pipe = tiny_zimage_pipeline()
    adapter = ZImageAdapter(pipe)
    with torch.no_grad():
        embeds = adapter.encode_prompts(PROMPTS[:1], False, MAX_SEQ)
        t = adapter.schedule(2, 128, 32).timesteps[0]
        adapter.check_size(128, 32)
        adapter.velocity(pipe.transformer, adapter.initial_noise(1, 128, 32, torch.Generator()), t, embeds, 0.0)
        with pytest.raises(ValueError, match="height=132"):
            adapter.check_size(132, 32)
        with pytest.raises(IndexError):
            adapter.velocity(pipe.transformer, adapter.initial_noise(1, 132, 32, torch.Generator()), t, embeds, 0.0)


def test_recipe_settings_train_on_the_tiny_pipeline(tmp_path):
    """The GPU recipe's Z-Image-specific settings (guidance 0, one stochastic step in a window, its LoRA targets
    incl. the feed-forward w1/w2/w3) train on the tiny pipeline; only sizes and batch are shrunk."""
    from trl_flow import FlowGRPOTrainer, cli

    _, config, _ = cli.parse_args("grpo", [
        "--config", "zimage_turbo_flow_grpo", "--output_dir", str(tmp_path / "out"), "--bf16", "false",
        "--height", "32", "--width", "32", "--max_sequence_length", str(MAX_SEQ), "--max_steps", "1",
        "--num_generations", "2", "--prompts_per_step", "2", "--per_device_train_batch_size", "4",
        "--gradient_accumulation_steps", "1", "--gradient_checkpointing", "false", "--lora_r", "4",
        "--lora_alpha", "8", "--disable_tqdm", "true"])
    assert (config.guidance_scale, config.sde_window_size, config.num_inference_steps) == (0.0, 1, 6)
    trainer = FlowGRPOTrainer(config, tiny_zimage_pipeline(), [video_or_image_brightness], train_dataset=PROMPTS)
    wrapped = {n.split(".lora_")[0] for n, _ in trainer.pipe.transformer.named_parameters() if ".lora_" in n}
    assert {m.rsplit(".", 1)[1] for m in wrapped if ".feed_forward." in m} == {"w1", "w2", "w3"}
    state = trainer.train()
    entry = state.log_history[0]
    assert entry["ratio_first_max_dev"] == 0.0 and torch.isfinite(torch.tensor(entry["loss"]))
