"""What is particular to Qwen-Image (QwenImagePipeline, QwenImageAdapter): the schedule, prompt encoding, true CFG
with its norm rescaling, loading, long prompts, options, the recipe. Parity, every trainer, the LoRA round trip,
resume with EMA, bad sizes: row "qwen-image" of test_models_conformance.py.

Tiny random QwenImagePipeline (trl_flow.testing.tiny_qwen_image_pipeline), 32 x 32 px: latents (4, 8, 8), 16 image
tokens; prompts of 9 to 13 tokens after the template (so a batch is padded and masked).
"""

from __future__ import annotations

import pytest
import torch
from conftest import HEIGHT, MAX_SEQ, PROMPTS, WIDTH, velocity_and_input_grad

from trl_flow.models import get_adapter
from trl_flow.models.qwen_image import QwenImageAdapter
from trl_flow.testing import tiny_qwen_image_pipeline


# ----------------------------------------------------------------------------- schedule, encoding, guidance
def test_schedule_ends_at_shift_terminal():
    adapter = get_adapter(tiny_qwen_image_pipeline())
    assert type(adapter) is QwenImageAdapter and adapter.pipeline_tag == "text-to-image"
    schedule = adapter.schedule(4, HEIGHT, WIDTH)
    assert float(schedule.sigmas[0]) == 1.0 and float(schedule.sigmas[-1]) == 0.0
    assert float(schedule.sigmas[-2]) == pytest.approx(0.02)  # Qwen-Image's shift_terminal


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
    assert len(set(ours["prompt_embeds_mask"][:3].sum(dim=1).tolist())) == 3  # three lengths: the mask is used
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
        return velocity_and_input_grad(adapter, pipe.transformer, x0, t, embeds, 4.0, detach)

    v_full, g_full = value_and_grad(False)
    v_cond_only, g_cond_only = value_and_grad(True)
    assert torch.equal(v_full, v_cond_only)
    assert not torch.allclose(g_full, g_cond_only)


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
