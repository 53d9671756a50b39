"""What is particular to FLUX.2-dev (Flux2Pipeline) and FLUX.2 [klein] (Flux2KleinPipeline): schedule, guidance,
LoRA targets, resume with EMA and two update passes, loading, recipes. Parity, every trainer, the LoRA round trip and
bad sizes: rows "flux2", "flux2-klein", "flux2-klein-distilled" of test_models_conformance.py.

Tiny random pipelines (trl_flow.testing.flux2), 32 x 32 px, latents (16, 8, 8), prompts of up to 40 tokens (the
chat templates take about 25 of them).
"""

from __future__ import annotations

import pytest
import torch
from conftest import HEIGHT, PROMPTS, WIDTH, velocity_and_input_grad

from trl_flow.models import get_adapter, load_pipeline
from trl_flow.models.flux2 import Flux2Adapter, Flux2KleinAdapter
from trl_flow.testing import tiny_flux2_klein_pipeline, tiny_flux2_pipeline

MAX_SEQ = 40
FAMILIES = ("flux2", "klein")
GUIDANCE = {"flux2": 4.0, "klein": 4.0}  # FLUX.2-dev: distilled (embedding); Klein base: true CFG


def make_pipe(family, **kwargs):
    return tiny_flux2_pipeline(**kwargs) if family == "flux2" else tiny_flux2_klein_pipeline(**kwargs)


def brightness(images, prompts, **columns):
    return images.mean(dim=(1, 2, 3))


def flux2_config(config_class, tmp_path, family, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path / "out"), max_steps=2, num_generations=2, prompts_per_step=4,
        per_device_train_batch_size=4, height=HEIGHT, width=WIDTH, max_sequence_length=MAX_SEQ,
        num_inference_steps=3, eval_num_inference_steps=3, per_device_eval_batch_size=4,
        guidance_scale=GUIDANCE[family], lora_r=4, lora_alpha=8, learning_rate=1e-2, clip_range=5e-2, beta=0.01,
        disable_tqdm=True,
    )
    kwargs.update(overrides)
    return config_class(**kwargs)


def test_schedule_is_the_pipelines_empirical_shift():
    """FLUX.2's mu depends on the image tokens and the number of steps: the adapter's sigmas are the scheduler's
    after pipe() with the same size and steps, at several of each."""
    pipe = make_pipe("flux2")
    adapter = get_adapter(pipe)
    for steps, size in ((3, 32), (8, 64), (28, 48)):
        schedule = adapter.schedule(steps, size, size)
        pipe(prompt="a cat", height=size, width=size, num_inference_steps=steps, max_sequence_length=MAX_SEQ,
             output_type="latent")
        assert torch.equal(schedule.sigmas, pipe.scheduler.sigmas.float())
        assert torch.equal(schedule.timesteps, pipe.scheduler.timesteps)
    assert not torch.equal(adapter.schedule(8, 32, 32).sigmas, adapter.schedule(8, 64, 64).sigmas)


def test_flux2_dev_guidance_is_the_distilled_embedding():
    """FLUX.2-dev: guidance_scale reaches the transformer as `guidance` (one pass), and changes the velocity; no
    negative prompt is encoded."""
    pipe = make_pipe("flux2")
    adapter = get_adapter(pipe)
    seen = []
    hook = pipe.transformer.register_forward_hook(lambda m, a, kw, o: seen.append(kw["guidance"]), with_kwargs=True)
    x = adapter.initial_noise(2, HEIGHT, WIDTH, torch.Generator().manual_seed(0))
    with torch.no_grad():
        embeds = adapter.encode_prompts(PROMPTS[:2], True, MAX_SEQ)
        t = adapter.schedule(4, HEIGHT, WIDTH).timesteps[1]
        v1 = adapter.velocity(pipe.transformer, x, t, embeds, 1.0)
        v4 = adapter.velocity(pipe.transformer, x, t, embeds, 4.0)
    hook.remove()
    assert set(embeds) == {"prompt_embeds"}
    assert len(seen) == 2 and seen[1].tolist() == [4.0, 4.0]
    assert not torch.allclose(v1, v4)


def test_klein_cfg_and_distilled_guidance():
    """Klein base: CFG against the empty prompt (the negative embeddings are the empty prompt's; w changes the
    velocity). Step-distilled Klein: no negative prompt, guidance ignored, one warning at configure."""
    pipe = make_pipe("klein")
    adapter = get_adapter(pipe)
    with torch.no_grad():
        embeds = adapter.encode_prompts(PROMPTS[:2], True, MAX_SEQ)
        empty = adapter.encode_prompts(["", ""], False, MAX_SEQ)["prompt_embeds"]
        x = adapter.initial_noise(2, HEIGHT, WIDTH, torch.Generator().manual_seed(0))
        t = adapter.schedule(4, HEIGHT, WIDTH).timesteps[1]
        v2, v4 = (adapter.velocity(pipe.transformer, x, t, embeds, w) for w in (2.0, 4.0))
    assert torch.equal(embeds["negative_prompt_embeds"], empty) and not torch.allclose(v2, v4)

    from trl_flow import FlowGRPOConfig

    distilled = get_adapter(make_pipe("klein", is_distilled=True))
    with torch.no_grad():
        assert set(distilled.encode_prompts(PROMPTS[:2], True, MAX_SEQ)) == {"prompt_embeds"}
    with pytest.warns(UserWarning, match="step-distilled"):
        distilled.configure(FlowGRPOConfig(output_dir="unused", guidance_scale=4.0, max_sequence_length=MAX_SEQ))


def test_klein_detach_uncond_keeps_value_and_drops_uncond_gradient():
    pipe = make_pipe("klein")
    adapter = get_adapter(pipe)
    with torch.no_grad():
        embeds = adapter.encode_prompts(PROMPTS[:2], True, MAX_SEQ)
    t = adapter.schedule(4, HEIGHT, WIDTH).timesteps[1]
    x0 = adapter.initial_noise(2, HEIGHT, WIDTH, torch.Generator().manual_seed(0))

    def value_and_grad(detach):
        return velocity_and_input_grad(adapter, pipe.transformer, x0, t, embeds, 3.0, detach)

    v_full, g_full = value_and_grad(False)
    v_cond, g_cond = value_and_grad(True)
    assert torch.equal(v_full, v_cond) and not torch.allclose(g_full, g_cond)


def test_default_lora_targets_are_diffusers_flux2_scripts():
    """diffusers' train_dreambooth_lora_flux2(_klein).py defaults: to_k/q/v, to_out.0, to_qkv_mlp_proj and every
    single block's attn.to_out (48 named for FLUX.2-dev, 24 for Klein); on a model they adapt exactly the
    image-stream attention of the double blocks and both projections of the single blocks."""
    from peft import LoraConfig

    head = ("to_k", "to_q", "to_v", "to_out.0", "to_qkv_mlp_proj")
    for adapter, n in ((Flux2Adapter, 48), (Flux2KleinAdapter, 24)):
        targets = adapter.default_lora_target_modules
        assert targets[:5] == head and targets[5:] == tuple(f"single_transformer_blocks.{i}.attn.to_out"
                                                            for i in range(n))
    transformer = make_pipe("flux2", num_single_layers=2).transformer
    transformer.add_adapter(LoraConfig(r=2, target_modules=list(Flux2Adapter.default_lora_target_modules)))
    adapted = sorted(n.rsplit(".lora_A", 1)[0] for n, _ in transformer.named_parameters() if ".lora_A." in n)
    assert adapted == sorted(
        [f"transformer_blocks.0.attn.{p}" for p in ("to_k", "to_q", "to_v", "to_out.0")]
        + [f"single_transformer_blocks.{i}.attn.{p}" for i in range(2) for p in ("to_out", "to_qkv_mlp_proj")])


# ----------------------------------------------------------------------------------------- resume, loading
@pytest.mark.parametrize("family", FAMILIES)
def test_resume_repeats_an_uninterrupted_run(tmp_path, family):
    """4 iterations straight == 2 iterations, checkpoint, a fresh trainer resumed for 2 more: LoRA, EMA and logged
    values bit for bit (KL to the reference and EMA on, two update passes)."""
    from trl_flow import FlowGRPOConfig, FlowGRPOTrainer

    def run(name, max_steps, resume=None, **kw):
        config = flux2_config(FlowGRPOConfig, tmp_path, family, output_dir=str(tmp_path / name), max_steps=max_steps,
                              ema_decay=0.9, num_inner_epochs=2, learning_rate=3e-3, **kw)
        trainer = FlowGRPOTrainer(config, make_pipe(family), [brightness], train_dataset=PROMPTS + ["a house"])
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    def lora(trainer):
        return {n: p.detach().clone() for n, p in trainer.pipe.transformer.named_parameters() if "lora_" in n}

    straight = run("a", 4)
    run("b", 2, save_steps=2)
    torch.manual_seed(1234)  # everything must come from the checkpoint
    resumed = run("b", 4, resume=str(tmp_path / "b" / "checkpoint-2"), save_steps=2)
    assert resumed.state.global_step == 4
    wa, wb = lora(straight), lora(resumed)
    assert wa.keys() == wb.keys() and wa and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert all(torch.equal(a, b) for a, b in zip(straight.ema.shadow_params, resumed.ema.shadow_params))
    keys = ("loss", "reward", "kl", "ratio_max")
    assert [[e[k] for k in keys] for e in resumed.state.log_history[2:]] == [
        [e[k] for k in keys] for e in straight.state.log_history[2:]]


@pytest.mark.parametrize("family", FAMILIES)
def test_load_pipeline_round_trip(tmp_path, family):
    """A tiny pipeline saved with save_pretrained loads through load_pipeline (the real loading path), gets its
    adapter and samples exactly as the original."""
    pipe = make_pipe(family, is_distilled=True) if family == "klein" else make_pipe(family)
    pipe.save_pretrained(tmp_path / "pipe")
    loaded = load_pipeline(str(tmp_path / "pipe"))
    assert type(loaded) is type(pipe)
    assert type(get_adapter(loaded)) is (Flux2Adapter if family == "flux2" else Flux2KleinAdapter)
    if family == "klein":
        assert loaded.config.is_distilled is True
    call = dict(prompt=["a cat"], height=HEIGHT, width=WIDTH, num_inference_steps=2, max_sequence_length=MAX_SEQ,
                output_type="latent")
    assert torch.equal(pipe(generator=torch.Generator().manual_seed(0), **call).images,
                       loaded(generator=torch.Generator().manual_seed(0), **call).images)


def test_bad_text_encoder_layers_are_refused():
    with pytest.raises(ValueError, match="text_encoder_out_layers=\\(9, 18, 40\\): the text encoder has 27 layers"):
        Flux2KleinAdapter(make_pipe("klein"), text_encoder_out_layers=(9, 18, 40))


@pytest.mark.parametrize("name,family", [("flux2_dev_flow_grpo", "flux2"), ("flux2_klein_flow_grpo", "klein")])
def test_recipe_targets_and_batch_layout(name, family):
    """The GPU recipes: the real Hub ids; their LoRA targets (Flow-Factory's) adapt both streams' attention and
    feed-forward projections of the double blocks and the single blocks' fused input projection; 768 samples per
    iteration on 8 processes are 2 optimizer steps (as Flow-Factory's gradient_step_per_epoch: 2)."""
    import yaml
    from peft import LoraConfig

    from trl_flow import cli

    with open(cli.shipped("recipes")[name]) as f:
        recipe = yaml.safe_load(f)
    assert recipe["model_name_or_path"] == {"flux2": "black-forest-labs/FLUX.2-dev",
                                            "klein": "black-forest-labs/FLUX.2-klein-base-9B"}[family]
    per_process = recipe["prompts_per_step"] * recipe["num_generations"] // 8
    assert per_process // (recipe["per_device_train_batch_size"] * recipe["gradient_accumulation_steps"]) == 2
    transformer = make_pipe(family).transformer
    transformer.add_adapter(LoraConfig(r=2, target_modules=recipe["lora_target_modules"]))
    adapted = sorted(n.rsplit(".lora_A", 1)[0] for n, _ in transformer.named_parameters() if ".lora_A." in n)
    double = [f"transformer_blocks.0.attn.{p}" for p in ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj",
                                                          "add_k_proj", "add_v_proj", "to_add_out")]
    double += [f"transformer_blocks.0.{ff}.{p}" for ff in ("ff", "ff_context") for p in ("linear_in", "linear_out")]
    assert adapted == sorted(double + ["single_transformer_blocks.0.attn.to_qkv_mlp_proj"])
