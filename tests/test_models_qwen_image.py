"""Qwen-Image (QwenImagePipeline) through QwenImageAdapter: parity with pipe(), true CFG with its norm rescaling,
every trainer, LoRA round trip through the pipeline's loader, resume, loading, bad input.

Tiny random QwenImagePipeline (trl_flow.testing.tiny_qwen_image_pipeline), 32 x 32 px: latents (4, 8, 8), 16 image
tokens; prompts of 9 to 13 tokens after the template (so a batch is padded and masked).
"""

from __future__ import annotations

import pytest
import torch
from conftest import HEIGHT, MAX_SEQ, PROMPTS, WIDTH
from test_models_families import exported_trainers, family_config, video_or_image_brightness

from trl_flow.models import get_adapter
from trl_flow.models.qwen_image import QwenImageAdapter
from trl_flow.testing import tiny_qwen_image_pipeline


def qwen_config(config_class, tmp_path, **overrides):
    return family_config(config_class, tmp_path, "qwen", **overrides)  # guidance_scale 4.5: true CFG, two passes


def lora_params(trainer):
    return {n: p.detach().clone() for n, p in trainer.pipe.transformer.named_parameters() if "lora_" in n}


# ------------------------------------------------------------------------------------------- pipeline parity
@pytest.mark.parametrize("true_cfg_scale,negative_prompt", [(1.0, None), (4.0, "ugly")], ids=["plain", "true-cfg"])
def test_ode_rollout_reproduces_pipeline_exactly(true_cfg_scale, negative_prompt):
    """The `ode` kernel over the adapter's schedule, from the adapter's noise, ends exactly where
    pipe(output_type="latent") ends (prompts of different lengths: padded, masked); decode is exactly the
    pipeline's output_type="pt"."""
    from trl_flow.rollout import sample_trajectories

    pipe = tiny_qwen_image_pipeline()
    adapter = get_adapter(pipe, **({} if negative_prompt is None else {"negative_prompt": negative_prompt}))
    assert type(adapter) is QwenImageAdapter and adapter.pipeline_tag == "text-to-image"
    prompts, K = PROMPTS[:3], 4
    call = dict(height=HEIGHT, width=WIDTH, num_inference_steps=K, max_sequence_length=MAX_SEQ,
                true_cfg_scale=true_cfg_scale)
    if negative_prompt is not None:
        call["negative_prompt"] = [negative_prompt] * len(prompts)
    expected = pipe(prompts, generator=torch.Generator().manual_seed(3), output_type="latent", **call).images
    noise = adapter.initial_noise(len(prompts), HEIGHT, WIDTH, torch.Generator().manual_seed(3))
    with torch.no_grad():
        embeds = adapter.encode_prompts(prompts, true_cfg_scale > 1, MAX_SEQ)
    assert ("negative_prompt_embeds" in embeds) == (true_cfg_scale > 1)
    assert len(set(embeds["prompt_embeds_mask"].sum(dim=1).tolist())) == 3  # three lengths: the mask is used
    schedule = adapter.schedule(K, HEIGHT, WIDTH)
    assert float(schedule.sigmas[0]) == 1.0 and float(schedule.sigmas[-1]) == 0.0
    assert float(schedule.sigmas[-2]) == pytest.approx(0.02)  # Qwen-Image's shift_terminal
    traj = sample_trajectories(adapter, pipe.transformer, embeds, noise, schedule, ["ode"] * K, 0.0,
                               true_cfg_scale, batch_size=len(prompts))
    final = traj["states"][:, -1]
    assert final.shape == (3, 4, HEIGHT // 4, WIDTH // 4)  # stored unpacked; the pipeline returns packed
    assert torch.equal(adapter.pack(final), expected)
    decoded = pipe(prompts, generator=torch.Generator().manual_seed(3), output_type="pt", **call).images
    with torch.no_grad():
        ours = adapter.decode(final)
    assert ours.shape == (3, *adapter.output_shape(HEIGHT, WIDTH))
    assert torch.equal(ours, decoded)


def test_prompt_encoding_is_the_pipelines():
    """The template's 34-token system prefix is what the tiny tokenizer makes of it (as Qwen's real BPE), and the
    stored embeddings, cut to the mask, are pipe.encode_prompt's."""
    pipe = tiny_qwen_image_pipeline()
    prefix = pipe.prompt_template_encode.split("{}")[0]
    ids = pipe.tokenizer(prefix).input_ids
    assert len(ids) == pipe.prompt_template_encode_start_idx == 34
    assert pipe.tokenizer.convert_ids_to_tokens(ids)[-3:] == ["<|im_start|>", "user", "Ċ"]
    adapter = QwenImageAdapter(pipe)
    with torch.no_grad():
        ours = adapter.encode_prompts(PROMPTS, True, MAX_SEQ)
        pe, mask = pipe.encode_prompt(PROMPTS, max_sequence_length=MAX_SEQ)
        npe, nmask = pipe.encode_prompt([" "] * 4, max_sequence_length=MAX_SEQ)
    assert ours["prompt_embeds"].shape == (4, MAX_SEQ, 32)  # padded to max_sequence_length: batches concatenate
    n = pe.shape[1]
    assert torch.equal(ours["prompt_embeds"][:, :n], pe) and torch.equal(ours["prompt_embeds_mask"][:, :n], mask)
    assert not ours["prompt_embeds"][:, n:].any() and not ours["prompt_embeds_mask"][:, n:].any()
    assert nmask is None and torch.equal(ours["negative_prompt_embeds"], npe)  # one prompt: its own length


def test_true_cfg_rescales_to_the_conditional_norm_and_detach_keeps_the_value():
    """Guided: each token's packed velocity has the conditional prediction's norm (the pipeline's rescaling), and
    is not the conditional one; guidance_grad='cond_only' keeps the value and changes the gradient."""
    pipe = tiny_qwen_image_pipeline()
    adapter = QwenImageAdapter(pipe, negative_prompt="blurry")
    with torch.no_grad():
        embeds = adapter.encode_prompts(PROMPTS[:2], True, MAX_SEQ)
    t = adapter.schedule(4, HEIGHT, WIDTH).timesteps[1]
    x0 = adapter.initial_noise(2, HEIGHT, WIDTH, torch.Generator().manual_seed(0))
    with torch.no_grad():
        v_cond = adapter.pack(adapter.velocity(pipe.transformer, x0, t, embeds, 1.0))
        v_cfg = adapter.pack(adapter.velocity(pipe.transformer, x0, t, embeds, 4.0))
    torch.testing.assert_close(v_cfg.norm(dim=-1), v_cond.norm(dim=-1))
    assert not torch.allclose(v_cfg, v_cond, atol=1e-3)

    def value_and_grad(detach):
        x = x0.clone().requires_grad_(True)
        v = adapter.velocity(pipe.transformer, x, t, embeds, 4.0, detach_uncond=detach)
        (v * torch.linspace(-1, 1, v.numel()).view_as(v)).sum().backward()
        return v.detach(), x.grad

    v_full, g_full = value_and_grad(False)
    v_cond_only, g_cond_only = value_and_grad(True)
    assert torch.equal(v_full, v_cond_only)
    assert not torch.allclose(g_full, g_cond_only)


# ---------------------------------------------------------------------------------------- every trainer
@pytest.mark.parametrize("trainer_class", exported_trainers(), ids=lambda c: c.__name__)
def test_every_trainer_trains_on_qwen_image(tmp_path, trainer_class):
    """Two iterations with true CFG; the first ratio of each is exactly 1 (where the method has one), the loss is
    finite, the LoRA moves, rewards get (B, 3, H, W) images."""
    seen = []

    def reward(images, prompts, **columns):
        seen.append(tuple(images.shape))
        return video_or_image_brightness(images, prompts)

    config = qwen_config(trainer_class.config_class, tmp_path)
    trainer = trainer_class(config, tiny_qwen_image_pipeline(), [reward], train_dataset=PROMPTS)
    assert isinstance(trainer.adapter, QwenImageAdapter)
    before = lora_params(trainer)
    assert before and all(".to_" in n for n in before)  # diffusers' Qwen-Image LoRA targets
    state = trainer.train()
    assert all(s[1:] == (3, HEIGHT, WIDTH) for s in seen)
    assert len(state.log_history) == 2
    for entry in state.log_history:
        assert entry.get("ratio_first_max_dev", 0.0) == 0.0  # (a trainer without a likelihood ratio logs none)
        assert entry.get("kl_old_first_max", 0.0) == 0.0
        assert torch.isfinite(torch.tensor(entry["loss"])) and entry["nonfinite_skipped"] == 0
    after = lora_params(trainer)
    assert any(not torch.equal(before[n], after[n]) for n in before)


def test_lora_round_trips_through_the_pipeline_loader(tmp_path):
    """save_model -> a fresh pipeline's QwenImagePipeline.load_lora_weights -> exactly the trained pipeline's
    samples (true CFG, the negative prompt " ")."""
    from trl_flow import FlowGRPOConfig, FlowGRPOTrainer

    config = qwen_config(FlowGRPOConfig, tmp_path, max_steps=1, beta=0.0)
    trainer = FlowGRPOTrainer(config, tiny_qwen_image_pipeline(), [video_or_image_brightness], train_dataset=PROMPTS)
    trainer.train()
    out = trainer.save_model(str(tmp_path / "final"))
    fresh = tiny_qwen_image_pipeline()
    call = dict(prompt=["a cat", "a red dog"], negative_prompt=" ", true_cfg_scale=4.5, height=HEIGHT, width=WIDTH,
                num_inference_steps=3, max_sequence_length=MAX_SEQ, output_type="latent")

    def run(pipe):
        with torch.no_grad():
            return pipe(generator=torch.Generator().manual_seed(0), **call)[0]

    base = run(fresh)
    fresh.load_lora_weights(out)
    loaded, trained = run(fresh), run(trainer.pipe)
    assert torch.equal(loaded, trained)
    assert (loaded - base).abs().max() > 1e-4  # the LoRA is not a no-op
    targets = set(fresh.transformer.peft_config["default_0"].target_modules)
    assert targets == {"to_k", "to_q", "to_v", "to_out.0"}


def test_resume_repeats_an_uninterrupted_run(tmp_path):
    """Checkpoint at iteration 1, resume to 3 in a fresh trainer and pipeline: the LoRA, the EMA and the logged
    values are bit-identical to an uninterrupted 3-iteration run (KL to the reference, EMA, true CFG)."""
    from trl_flow import FlowGRPOConfig, FlowGRPOTrainer

    def make(name, **kw):
        config = qwen_config(FlowGRPOConfig, tmp_path, output_dir=str(tmp_path / name), beta=0.01, ema_decay=0.9,
                             **kw)
        return FlowGRPOTrainer(config, tiny_qwen_image_pipeline(), [video_or_image_brightness],
                               train_dataset=PROMPTS)

    run_a = make("a", max_steps=3)
    run_a.train()
    make("b", max_steps=1, save_steps=1).train()
    torch.manual_seed(1234)  # a different global RNG state: everything must come from the checkpoint
    resumed = make("b", max_steps=3, save_steps=1)
    resumed.train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-1"))
    assert resumed.state.global_step == 3
    wa, wb = lora_params(run_a), lora_params(resumed)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[n], wb[n]) for n in wa)
    assert all(torch.equal(a, b) for a, b in zip(run_a.ema.shadow_params, resumed.ema.shadow_params))
    for a, b in zip(run_a.state.log_history[1:], resumed.state.log_history[1:]):
        assert (a["step"], a["loss"], a["reward"], a["kl"]) == (b["step"], b["loss"], b["reward"], b["kl"])


# ------------------------------------------------------------------------------------------- loading, bad input
def test_load_pipeline_round_trip(tmp_path):
    """A tiny pipeline saved with save_pretrained loads through load_pipeline (tokenizer included) and samples
    exactly as the original."""
    from trl_flow.models import load_pipeline

    original = tiny_qwen_image_pipeline()
    original.save_pretrained(tmp_path / "pipe")
    pipe = load_pipeline(str(tmp_path / "pipe"))
    assert type(get_adapter(pipe)) is QwenImageAdapter
    assert len(pipe.tokenizer(pipe.prompt_template_encode.split("{}")[0]).input_ids) == 34
    call = dict(prompt=["a cat", "a red dog"], height=HEIGHT, width=WIDTH, num_inference_steps=2,
                max_sequence_length=MAX_SEQ, output_type="latent")
    with torch.no_grad():
        a = original(generator=torch.Generator().manual_seed(0), **call)[0]
        b = pipe(generator=torch.Generator().manual_seed(0), **call)[0]
    assert torch.equal(a, b)


@pytest.mark.parametrize("overrides,match", [
    ({"height": 36}, "height=36, width=32: must be multiples of 8"),  # the pipeline would only warn and resize
    ({"width": 65536}, "rotary embedding has 4096 positions"),
    ({"max_sequence_length": 2048}, "max_sequence_length=2048: QwenImagePipeline takes at most 1024"),
])
def test_bad_config_fails_before_compute(tmp_path, overrides, match):
    from trl_flow import FlowGRPOConfig, FlowGRPOTrainer

    calls = []
    config = qwen_config(FlowGRPOConfig, tmp_path, **overrides)
    with pytest.raises(ValueError, match=match):
        FlowGRPOTrainer(config, tiny_qwen_image_pipeline(), [lambda im, p, **c: calls.append(1) or [0.0] * len(p)],
                        train_dataset=PROMPTS)
    assert calls == []


def test_a_prompt_cut_at_max_sequence_length_warns_once():
    """pipe.encode_prompt cuts a prompt longer than max_sequence_length silently: the trainer's guard says so, once,
    counting the prompt's tokens with the template's closing tokens as the pipeline does (46 here)."""
    import warnings

    from trl_flow.engine.guards import LongPromptWarning

    guard = LongPromptWarning(QwenImageAdapter(tiny_qwen_image_pipeline()), MAX_SEQ)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        guard.check(PROMPTS)  # 9 to 13 tokens: no warning
    long = "a dog " * 10
    with pytest.warns(UserWarning, match=r"1 of 2 distinct prompts .* exceed the 16-token limit of pipe.tokenizer .*"
                                         r"prompt 1 of the batch, 46 tokens"):
        guard.check(["a cat", long])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        guard.check([long])  # reported once


def test_bad_adapter_options():
    pipe = tiny_qwen_image_pipeline()
    with pytest.raises(TypeError, match="negative_prompt"):
        QwenImageAdapter(pipe, negative_prompt=None)
    pipe.transformer.register_to_config(guidance_embeds=True)
    with pytest.raises(ValueError, match="guidance_embeds=True"):
        QwenImageAdapter(pipe)


def test_recipe_targets_exist_in_the_qwen_image_transformer():
    """The GPU recipe names the real Hub id, true CFG 4, and LoRA targets each of which matches modules of
    QwenImageTransformer2DModel (a misspelt target would be silently left out by PEFT when others match)."""
    import yaml

    from trl_flow import cli

    with open(cli.shipped("recipes")["qwen_image_flow_grpo"]) as f:
        recipe = yaml.safe_load(f)
    assert recipe["model_name_or_path"] == "Qwen/Qwen-Image" and recipe["guidance_scale"] == 4.0
    names = [n for n, _ in tiny_qwen_image_pipeline().transformer.named_modules()]
    for target in recipe["lora_target_modules"] + list(QwenImageAdapter.default_lora_target_modules):
        assert sum(n.endswith("." + target) for n in names) == 2, target  # once per block (2 blocks)
