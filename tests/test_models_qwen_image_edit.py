"""What is particular to Qwen-Image-Edit (QwenImageEditPipeline, and QwenImageEditPlusPipeline for -2509): the 1 MP
source rule, source conditioning, options, evaluation, bad sources, the recipe. Parity, every trainer, the LoRA round
trip, resume with EMA: rows "qwen-image-edit" and "qwen-image-plus" of test_models_conformance.py.

Tiny random pipelines (trl_flow.testing.qwen_image_edit), 32 x 32 px generated images (latents (4, 8, 8), 16
tokens). The pipelines resize every source to 1 MP (16384 tokens of this VAE, ~25 s to encode on CPU), so the
adapter runs with ``source_size="output"`` (32 x 32: 16 source tokens); the conformance suite compares pipe() with
its source area set to the same; ``test_auto_source_is_the_pipelines_1mp_image`` checks the 1 MP rule itself on the
inputs of the vision-language encoder and the VAE.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from conftest import EDIT_PROMPTS as PROMPTS
from conftest import HEIGHT, MAX_SEQ, WIDTH
from conftest import source_image as source
from test_models_families import family_config

from trl_flow.models import get_adapter
from trl_flow.models.qwen_image_edit import QwenImageEditAdapter, QwenImageEditPlusAdapter
from trl_flow.testing import tiny_qwen_image_edit_pipeline

ADAPTERS = {"edit": QwenImageEditAdapter, "plus": QwenImageEditPlusAdapter}


def make_adapter(variant="edit", **kwargs):
    return ADAPTERS[variant](tiny_qwen_image_edit_pipeline(variant=variant), source_size="output", **kwargs)


def brightness(images, prompts, **columns):
    return images.mean(dim=(1, 2, 3))


def edit_config(config_class, tmp_path, **overrides):
    return family_config(config_class, tmp_path, "qwen", **overrides)  # guidance_scale 4.5: true CFG, two passes


@pytest.mark.parametrize("variant", ["edit", "plus"])
def test_auto_source_is_the_pipelines_1mp_image(variant):
    """source_size="auto" (the default): the vision-language encoder gets the same pixels (and grid) and the VAE the
    same (1, 3, 1, h, w) input as in pipe() at its 1 MP rule, for a non-square source (pipe() is stopped at the VAE;
    encoding 1 MP with the tiny VAE takes ~25 s). The Plus pipeline shows the VL encoder a 384 x 384-area image."""
    pipe = tiny_qwen_image_edit_pipeline(variant=variant)
    adapter = get_adapter(pipe)
    assert adapter.source_size == "auto" and adapter.conditioning == "text_and_image"
    src = source(5, (40, 24))
    seen = {"vl": [], "vae": []}

    class Stop(Exception):
        pass

    def at_vae(module, args):
        seen["vae"].append(args[0].clone())
        raise Stop

    hooks = [pipe.text_encoder.register_forward_pre_hook(
        lambda m, a, kw: seen["vl"].append((kw["pixel_values"].clone(), kw["image_grid_thw"].clone())),
        with_kwargs=True), pipe.vae.encoder.register_forward_pre_hook(at_vae)]
    with pytest.raises(Stop):
        pipe(image=src, prompt="make it red", true_cfg_scale=1.0, num_inference_steps=1, output_type="latent")
    (pixels, grid), = seen["vl"]
    vl_image, vae_image = adapter.source_inputs(src)
    with torch.no_grad():
        adapter._encode_vl("make it red", vl_image)
    for h in hooks:
        h.remove()
    assert torch.equal(seen["vl"][1][0], pixels) and torch.equal(seen["vl"][1][1], grid)
    assert torch.equal(vae_image, seen["vae"][0])
    assert vae_image.shape == (1, 3, 1, 800, 1312)  # calculate_dimensions(1024 * 1024, 40 / 24)
    assert adapter.source_size_of(src) == ((800, 1312), (288, 480) if variant == "plus" else (800, 1312))


def test_source_conditions_and_embeds_index_and_concatenate():
    """The source is conditioning: another source gives another velocity (image latents and the VL prompt both);
    a sample's embeddings do not depend on its batch (encoded alone == row of a batch, bit for bit), they index and
    concatenate like the text's, and a repeated (prompt, source) pair is encoded once."""
    from trl_flow.models import cat_embeds, index_embeds

    adapter = make_adapter(output_size=(HEIGHT, WIDTH))
    srcs = [source(0), source(1)]
    calls = []
    hook = adapter.pipe.text_encoder.register_forward_hook(lambda *a: calls.append(1))
    with torch.no_grad():
        both = adapter.encode_prompts(PROMPTS[:2] + PROMPTS[:1], True, MAX_SEQ, images=srcs + srcs[:1])
        assert len(calls) == 2 * 2  # two distinct pairs, conditional and negative
        one = adapter.encode_prompts(PROMPTS[1:2], True, MAX_SEQ, images=srcs[1:])
    hook.remove()
    for k in both:
        assert torch.equal(index_embeds(both, [1])[k], one[k]), k
        assert torch.equal(both[k][0], both[k][2]), k
    assert torch.equal(cat_embeds([index_embeds(both, [0]), one])["image_latents"], both["image_latents"][:2])
    # one prompt, two sources: the VL embeddings differ (the source's vision tokens), and each of the two parts of
    # the conditioning (VL embeddings, image latents) swapped alone changes the velocity
    with torch.no_grad():
        same = adapter.encode_prompts(PROMPTS[:1] * 2, True, MAX_SEQ, images=srcs)
    assert not torch.equal(same["prompt_embeds"][0], same["prompt_embeds"][1])
    x = adapter.initial_noise(1, HEIGHT, WIDTH, torch.Generator().manual_seed(0)).repeat(2, 1, 1, 1)
    t = adapter.schedule(3, HEIGHT, WIDTH).timesteps[1]
    vl = ("prompt_embeds", "prompt_embeds_mask", "negative_prompt_embeds", "negative_prompt_embeds_mask")
    with torch.no_grad():
        v = adapter.velocity(adapter.transformer, x, t, same, 4.5)
        v_latents = adapter.velocity(adapter.transformer, x, t,
                                     dict(same, image_latents=same["image_latents"].flip(0)),
                                     4.5)
        v_vl = adapter.velocity(adapter.transformer, x, t, dict(same, **{k: same[k].flip(0) for k in vl}), 4.5)
    assert not torch.allclose(v, v_latents) and not torch.allclose(v, v_vl)


def test_bad_sources_options_and_long_prompts():
    adapter = make_adapter(output_size=(HEIGHT, WIDTH))
    with pytest.raises(ValueError, match="needs images= with one source image per prompt"):
        adapter.encode_prompts(PROMPTS[:2], False, MAX_SEQ)
    with pytest.raises(ValueError, match="source_size='big'"):
        QwenImageEditAdapter(tiny_qwen_image_edit_pipeline(), source_size="big")
    auto = QwenImageEditAdapter(tiny_qwen_image_edit_pipeline())
    with pytest.raises(ValueError, match=r"mixes conditioning sizes \[\(800, 1312\), \(1024, 1024\)\]"):
        auto.encode_prompts(PROMPTS[:2], False, MAX_SEQ, images=[source(0), source(1, (40, 24))])
    with pytest.raises(ValueError, match=r"a 400x4 px source at source_size='output' is resized to"):
        adapter.source_size_of((400, 4))
    long = "a dog " * 10
    n = len(adapter.pipe.tokenizer(long).input_ids)
    assert n > MAX_SEQ
    with pytest.warns(UserWarning, match=rf"a prompt has {n} tokens, more than max_sequence_length=16.*does not cut"):
        with torch.no_grad():
            cut = adapter.encode_prompts(["a cat", long], False, MAX_SEQ, images=[source(0), source(0)])
    # cut to the stored length
    assert cut["prompt_embeds_mask"].sum(dim=1).tolist()[1] == cut["prompt_embeds"].shape[1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            adapter.encode_prompts([long], False, MAX_SEQ, images=[source(0)])  # reported once


def test_source_image_size_in_the_config_and_the_adapter(tmp_path, edit_dataset):
    """The config's source_image_size configures a pipeline given to a trainer; a conflicting adapter option is
    refused naming both; a pipeline without its Qwen2VLProcessor is refused."""
    from trl_flow import FlowGRPOConfig, FlowGRPOTrainer

    trainer = FlowGRPOTrainer(edit_config(FlowGRPOConfig, tmp_path, source_image_size="source"),
                              tiny_qwen_image_edit_pipeline(), [brightness], train_dataset=edit_dataset)
    assert trainer.adapter.source_size == "source" and trainer.adapter.source_size_of((40, 24)) == ((32, 32),) * 2
    with pytest.raises(ValueError, match=r"source_image_size='source' in the config, but the QwenImageEditAdapter "
                                         r"was built with source_size='output'; set it in one place"):
        FlowGRPOTrainer(edit_config(FlowGRPOConfig, tmp_path, source_image_size="source"), make_adapter(),
                        [brightness], train_dataset=edit_dataset)
    pipe = tiny_qwen_image_edit_pipeline()
    pipe.processor = None
    with pytest.raises(ValueError, match="has no processor"):
        get_adapter(pipe)


def test_evaluate_and_generate_condition_on_the_eval_sources(tmp_path, edit_dataset):
    """evaluate() samples each eval prompt with its own source; generate(columns=...) equals it, and swapping the
    sources changes the images."""
    from trl_flow import FlowGRPOConfig, FlowGRPOTrainer

    config = edit_config(FlowGRPOConfig, tmp_path, max_steps=1, source_image_size="output")
    trainer = FlowGRPOTrainer(config, tiny_qwen_image_edit_pipeline(), [brightness], train_dataset=edit_dataset,
                              eval_dataset=edit_dataset.select([0, 1]))
    m = trainer.evaluate()
    rows = edit_dataset.select([0, 1])[:]
    images, _ = trainer.generate(rows["prompt"], seed=config.seed + 10_007,
                                 columns={"source_image": rows["source_image"]})
    assert torch.equal(images, trainer.last_eval_images) and np.isfinite(m["eval/reward"])
    swapped, _ = trainer.generate(rows["prompt"], seed=config.seed + 10_007,
                                  columns={"source_image": rows["source_image"][::-1]})
    assert not torch.allclose(images, swapped)


# ------------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("bad,match", [
    ("missing", r"train_dataset: row 2, column `source_image`: image file '.*nope.png' not found"),
    ("garbage", r"train_dataset: row 2, column `source_image`: '.*bad.png' is not a readable image"),
    ("shape", r"train_dataset: row 2, column `source_image`: an image array must be \(H, W, 3\), \(3, H, W\) or "
              r"\(H, W\), got shape \(4, 4, 4\)"),
    ("aspect", r"train_dataset, column `source_image`: rows 0 \(32x32 px\) and 2 \(96x32 px\) are encoded at "
               r"different sizes \(1024x1024 and 1760x576, source_size='auto'\)"),
])
def test_bad_source_images_are_refused_before_any_compute(tmp_path, edit_dataset, bad, match):
    """A missing / unreadable / malformed source, or one of another aspect ratio: one line naming the row and the
    column, raised when the trainer is built, before the text encoder, the transformer or any reward runs."""
    from datasets import Dataset

    from trl_flow import FlowGRPOConfig, FlowGRPOTrainer

    rows = edit_dataset.to_dict()
    if bad == "missing":
        rows["source_image"][2] = str(tmp_path / "nope.png")
    elif bad == "garbage":
        (tmp_path / "bad.png").write_bytes(b"not an image")
        rows["source_image"][2] = str(tmp_path / "bad.png")
    elif bad == "shape":
        rows = {"prompt": PROMPTS, "source_image": [np.zeros((32, 32, 3), np.uint8)] * 4}
        rows["source_image"][2] = np.zeros((4, 4, 4), np.uint8)
    else:
        source(9, (96, 32)).save(tmp_path / "wide.png")
        rows["source_image"][2] = str(tmp_path / "wide.png")
    calls = []
    pipe = tiny_qwen_image_edit_pipeline()
    hooks = [m.register_forward_hook(lambda *a: calls.append("model")) for m in (pipe.transformer, pipe.text_encoder)]
    with pytest.raises(ValueError, match=match) as e:
        FlowGRPOTrainer(edit_config(FlowGRPOConfig, tmp_path), pipe,
                        [lambda im, p, **k: calls.append("reward") or [0.0] * len(p)],
                        train_dataset=Dataset.from_dict(rows))
    for h in hooks:
        h.remove()
    assert calls == [] and "\n" not in str(e.value)


def test_recipe_is_qwen_image_edit():
    """The GPU recipe names the real Hub id, true CFG 4, and LoRA targets each of which matches modules of the
    transformer (a misspelt target would be silently left out by PEFT when others match)."""
    import yaml

    from trl_flow import cli

    with open(cli.shipped("recipes")["qwen_image_edit_flow_grpo"]) as f:
        recipe = yaml.safe_load(f)
    assert recipe["model_name_or_path"] == "Qwen/Qwen-Image-Edit" and recipe["guidance_scale"] == 4.0
    names = [n for n, _ in tiny_qwen_image_edit_pipeline().transformer.named_modules()]
    for target in recipe["lora_target_modules"]:
        assert sum(n.endswith("." + target) for n in names) == 2, target  # once per block (2 blocks)
