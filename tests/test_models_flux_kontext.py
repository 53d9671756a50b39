"""What is particular to FLUX.1 Kontext (FluxKontextPipeline, image editing): sources, source sizes, evaluation,
loading, bad sources, the recipe. Parity, every trainer, the LoRA round trip, resume with EMA: row "flux-kontext" of
test_models_conformance.py.

Tiny random pipeline (trl_flow.testing.flux_kontext), 32 x 32 px generated and source images (latents (4, 16, 16)),
``source_size="source"`` (the pipeline's ``_auto_resize=False``; "auto" would encode every source at ~1024 px).
"""

from __future__ import annotations

import dataclasses
import numpy as np
import pytest
import torch
from conftest import EDIT_PROMPTS as PROMPTS
from conftest import HEIGHT, MAX_SEQ, WIDTH
from conftest import source_image as source
from PIL import Image
from test_hub import online_hub  # noqa: F401  (fixture)
from test_models_families import exported_trainers

from trl_flow.models import get_adapter, load_pipeline
from trl_flow.models.flux_kontext import FluxKontextAdapter
from trl_flow.testing import tiny_flux_kontext_pipeline

def make_adapter(**kwargs):
    return FluxKontextAdapter(tiny_flux_kontext_pipeline(**kwargs), source_size="source")


def brightness(images, prompts, **columns):
    return images.mean(dim=(1, 2, 3))


def kontext_config(config_class, tmp_path, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path / "out"), max_steps=2, num_generations=2, prompts_per_step=4,
        per_device_train_batch_size=4, height=HEIGHT, width=WIDTH, max_sequence_length=MAX_SEQ,
        num_inference_steps=3, eval_num_inference_steps=3, per_device_eval_batch_size=4, guidance_scale=2.5,
        lora_r=4, lora_alpha=8, learning_rate=1e-2, clip_range=5e-2, beta=0.01, disable_tqdm=True,
    )
    fields = {f.name for f in dataclasses.fields(config_class)}
    kwargs = {k: v for k, v in kwargs.items() if k in fields}  # DiffusionNFT has no clip_range
    kwargs.update(overrides)
    return config_class(**kwargs)


def test_source_changes_the_velocity_and_embeds_index_and_concatenate():
    """The source is conditioning: another source gives another velocity; a sample's conditioning does not depend
    on its batch (encoded alone == row of a batch), and the embeddings index / concatenate like the text's."""
    from trl_flow.models import cat_embeds, index_embeds

    adapter = make_adapter()
    srcs = [source(0), source(1)]
    with torch.no_grad():
        both = adapter.encode_prompts(PROMPTS[:2], False, MAX_SEQ, images=srcs)
        one = adapter.encode_prompts(PROMPTS[1:2], False, MAX_SEQ, images=srcs[1:])
        x = adapter.initial_noise(1, HEIGHT, WIDTH, torch.Generator().manual_seed(0)).repeat(2, 1, 1, 1)
        t = adapter.schedule(3, HEIGHT, WIDTH).timesteps[1]
        swapped = dict(both, image=both["image"].flip(0))
        v, v_swapped = (adapter.velocity(adapter.transformer, x, t, e, 2.5) for e in (both, swapped))
    assert torch.equal(index_embeds(both, [1])["image"], one["image"])
    assert torch.equal(cat_embeds([index_embeds(both, [0]), one])["image"], both["image"])
    assert not torch.allclose(v, v_swapped)


def test_sources_of_mixed_sizes_and_missing_images_are_refused():
    adapter = make_adapter()
    with pytest.raises(ValueError, match=r"mixes conditioning sizes \[\(24, 40\), \(32, 32\)\]"):
        adapter.encode_prompts(PROMPTS[:2], False, MAX_SEQ, images=[source(0), source(1, (40, 24))])
    with pytest.raises(ValueError, match="needs images= with one source image per prompt"):
        adapter.encode_prompts(PROMPTS[:2], False, MAX_SEQ)
    with pytest.raises(ValueError, match="source_size='big'"):
        FluxKontextAdapter(tiny_flux_kontext_pipeline(), source_size="big")


def test_auto_source_size_is_the_pipelines_preferred_resolution():
    """source_size="auto" picks the preferred Kontext resolution nearest the source's aspect ratio, as the
    pipeline's _auto_resize does; "source" keeps the size, rounded down to a multiple of 4 (2x VAE, 2x2 packing)."""
    pipe = tiny_flux_kontext_pipeline()
    auto, keep = FluxKontextAdapter(pipe), FluxKontextAdapter(pipe, source_size="source")
    assert auto.source_size_of(source(0, (64, 64))) == (1024, 1024)
    assert auto.source_size_of(source(0, (150, 64))) == (672, 1568)  # (height, width)
    assert keep.source_size_of(source(0, (43, 30))) == (28, 40)
    assert get_adapter(pipe).source_size == "auto" and get_adapter(pipe).conditioning == "text_and_image"


# ---------------------------------------------------------------------------------------------- training
def test_only_the_rows_of_an_iteration_are_decoded(tmp_path, edit_dataset, monkeypatch):
    """Lazy loading: one iteration of 1 prompt decodes only that prompt's source (not the dataset's 4)."""
    import trl_flow.editing as editing
    from trl_flow import FlowGRPOConfig, FlowGRPOTrainer

    decoded = []
    load = editing.load_source
    config = kontext_config(FlowGRPOConfig, tmp_path, max_steps=1, prompts_per_step=1, num_generations=2,
                            per_device_train_batch_size=2)
    trainer = FlowGRPOTrainer(config, make_adapter(), [brightness], train_dataset=edit_dataset)
    monkeypatch.setattr(editing, "load_source", lambda v, *a, **k: decoded.append(v) or load(v, *a, **k))
    trainer.train()
    assert len(set(decoded)) == 1 and decoded[0] in edit_dataset["source_image"]


def test_evaluate_and_generate_condition_on_the_eval_sources(tmp_path, edit_dataset):
    """evaluate() samples each eval prompt with its own source; generate(columns=...) equals it."""
    from trl_flow import FlowGRPOConfig, FlowGRPOTrainer

    config = kontext_config(FlowGRPOConfig, tmp_path, max_steps=1)
    trainer = FlowGRPOTrainer(config, make_adapter(), [brightness], train_dataset=edit_dataset,
                              eval_dataset=edit_dataset.select([0, 1]))
    m = trainer.evaluate()
    rows = edit_dataset.select([0, 1])[:]
    images, _ = trainer.generate(rows["prompt"], seed=config.seed + 10_007,
                                 columns={"source_image": rows["source_image"]})
    assert torch.equal(images, trainer.last_eval_images) and np.isfinite(m["eval/reward"])
    swapped, _ = trainer.generate(rows["prompt"], seed=config.seed + 10_007,
                                  columns={"source_image": rows["source_image"][::-1]})
    assert not torch.allclose(images, swapped)


# ------------------------------------------------------------------------------------------------ loading
def test_load_pipeline_round_trip(tmp_path):
    pipe = tiny_flux_kontext_pipeline()
    pipe.save_pretrained(tmp_path / "pipe")
    loaded = load_pipeline(str(tmp_path / "pipe"))
    assert type(loaded) is type(pipe) and type(get_adapter(loaded)) is FluxKontextAdapter
    call = dict(prompt=["make it red"], image=source(0), height=HEIGHT, width=WIDTH, max_area=HEIGHT * WIDTH,
                _auto_resize=False, num_inference_steps=2, max_sequence_length=MAX_SEQ, output_type="latent")
    # close, not bitwise: a FluxTransformer2DModel reloaded from safetensors differs by ~5e-7 in its output (the
    # plain FLUX.1 transformer too; every state-dict tensor is equal)
    torch.testing.assert_close(pipe(generator=torch.Generator().manual_seed(0), **call).images,
                               loaded(generator=torch.Generator().manual_seed(0), **call).images, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("bad,match", [
    ("missing", r"train_dataset: row 2, column `source_image`: image file '.*nope.png' not found"),
    ("garbage", r"train_dataset: row 2, column `source_image`: '.*bad.png' is not a readable image"),
    ("none", r"train_dataset: row 2, column `source_image`: no source image \(None\)"),
    ("no_column", r"train_dataset: no `source_image` column"),
])
def test_bad_source_images_are_refused_before_any_compute(tmp_path, edit_dataset, bad, match):
    """A missing / unreadable / absent source image: one line naming the row and the column, raised when the
    trainer is built, before the transformer or any reward runs."""
    from datasets import Dataset

    from trl_flow import FlowGRPOConfig, FlowGRPOTrainer

    rows = edit_dataset.to_dict()
    if bad == "missing":
        rows["source_image"][2] = str(tmp_path / "nope.png")
    elif bad == "garbage":
        (tmp_path / "bad.png").write_bytes(b"not an image")
        rows["source_image"][2] = str(tmp_path / "bad.png")
    elif bad == "none":
        rows["source_image"][2] = None
    else:
        del rows["source_image"]
    calls = []
    adapter = make_adapter()
    hook = adapter.transformer.register_forward_hook(lambda *a: calls.append("transformer"))
    with pytest.raises(ValueError, match=match) as e:
        FlowGRPOTrainer(kontext_config(FlowGRPOConfig, tmp_path), adapter,
                        [lambda im, p, **k: calls.append("reward") or [0.0] * len(p)],
                        train_dataset=Dataset.from_dict(rows))
    hook.remove()
    assert calls == [] and "\n" not in str(e.value)


def test_recipe_is_flux1_kontext_dev():
    import os

    import yaml

    path = os.path.join(os.path.dirname(__file__), "..", "trl_flow", "recipes", "flux1_kontext_flow_grpo.yaml")
    with open(path) as f:
        recipe = yaml.safe_load(f)
    assert recipe["model_name_or_path"] == "black-forest-labs/FLUX.1-Kontext-dev"


def test_sources_of_different_conditioning_sizes_are_refused_at_set_up(tmp_path, edit_dataset):
    """Rows whose sources would be encoded at different sizes cannot share a batch: refused when the trainer is
    built, naming both rows and sizes (under "auto" only a different aspect-ratio class counts)."""
    from trl_flow import FlowGRPOConfig, FlowGRPOTrainer

    source(9, (40, 24)).save(tmp_path / "wide.png")
    rows = edit_dataset.to_dict()
    rows["source_image"][3] = str(tmp_path / "wide.png")
    from datasets import Dataset

    with pytest.raises(ValueError, match=r"train_dataset, column `source_image`: rows 0 \(32x32 px\) and 3 \(40x24 "
                                         r"px\) are encoded at different sizes \(32x32 and 40x24, "
                                         r"source_size='source'"):
        FlowGRPOTrainer(kontext_config(FlowGRPOConfig, tmp_path), make_adapter(), [brightness],
                        train_dataset=Dataset.from_dict(rows))
    auto = FluxKontextAdapter(tiny_flux_kontext_pipeline())
    auto.check_source_sizes([(32, 32), (1000, 1010), (64, 64)], "ds")  # one class: (1024, 1024)
    with pytest.raises(ValueError, match=r"ds: rows 0 \(32x32 px\) and 1 \(150x64 px\).*1568x672"):
        auto.check_source_sizes([(32, 32), (150, 64)], "ds")


@pytest.mark.parametrize("trainer_class", exported_trainers(), ids=lambda c: c.__name__)
def test_kl_to_reference_takes_the_sources(tmp_path, edit_dataset, trainer_class):
    """kl_to_reference(prompts, columns=...) conditions on the sources: 0 before training (policy == reference),
    finite per prompt after an iteration, for every trainer."""
    config = kontext_config(trainer_class.config_class, tmp_path, max_steps=1)
    trainer = trainer_class(config, make_adapter(), [brightness], train_dataset=edit_dataset)
    rows = edit_dataset[:2]
    kw = dict(columns={"source_image": rows["source_image"]}, sampler="flow_sde", noise_level=0.7)
    assert torch.equal(trainer.kl_to_reference(rows["prompt"], **kw), torch.zeros(2))
    trainer.train()
    kl = trainer.kl_to_reference(rows["prompt"], **kw)
    assert kl.shape == (2,) and torch.isfinite(kl).all() and (kl > 0).all()


def test_push_to_hub_card_samples_with_the_sources(online_hub, tmp_path, edit_dataset):  # noqa: F811 (a fixture)
    """push_to_hub of an editing run: the before/after grid is sampled with the eval rows' sources (it raised
    'needs the source_image column' before), the card is tagged image-to-image and its code passes image=."""
    import ast

    from huggingface_hub import ModelCard

    from trl_flow import FlowGRPOConfig, FlowGRPOTrainer

    config = kontext_config(FlowGRPOConfig, tmp_path, max_steps=1, push_to_hub=True, hub_model_id="tiny-kontext",
                            hub_base_model="black-forest-labs/FLUX.1-Kontext-dev")
    trainer = FlowGRPOTrainer(config, make_adapter(), [brightness], train_dataset=edit_dataset,
                              eval_dataset=edit_dataset.select([0, 1]))
    trainer.train()
    card = ModelCard.load(online_hub.remote / "README.md")
    assert card.data.to_dict()["pipeline_tag"] == "image-to-image"
    usage = card.text.split("```python\n")[1].split("```")[0]
    ast.parse(usage)
    assert 'pipe(image=load_image("source.png"), prompt=' in usage and "FluxKontextPipeline" in usage
    assert Image.open(online_hub.remote / "images/before_after.png").size == (2 * WIDTH, 2 * HEIGHT)


def test_output_source_size_is_flow_grpos_resize_to_the_generated_size(tmp_path, edit_dataset):
    """source_image_size="output" (config) encodes every source at height x width: the ODE rollout equals
    pipe(image=image_processor.resize(source, H, W), _auto_resize=False) bit for bit, and sources of different
    sizes train together (no set-up refusal). A text-to-image adapter refuses the field; a conflicting adapter
    option is refused naming both."""
    from datasets import Dataset

    from trl_flow import FlowGRPOConfig, FlowGRPOTrainer
    from trl_flow.rollout import sample_trajectories
    from trl_flow.testing import tiny_flux_pipeline

    pipe = tiny_flux_kontext_pipeline()
    adapter = FluxKontextAdapter(pipe, source_size="output", output_size=(HEIGHT, WIDTH))
    src, K = source(3, (40, 24)), 3
    expected = pipe(prompt="make it red", image=pipe.image_processor.resize(src, HEIGHT, WIDTH), height=HEIGHT,
                    width=WIDTH, max_area=HEIGHT * WIDTH, _auto_resize=False, num_inference_steps=K,
                    guidance_scale=2.5, max_sequence_length=MAX_SEQ, generator=torch.Generator().manual_seed(0),
                    output_type="latent").images
    with torch.no_grad():
        embeds = adapter.encode_prompts(["make it red"], False, MAX_SEQ, images=[src])
    assert embeds["image"].shape == (1, 4, HEIGHT // 2, WIDTH // 2)
    noise = adapter.initial_noise(1, HEIGHT, WIDTH, torch.Generator().manual_seed(0))
    traj = sample_trajectories(adapter, pipe.transformer, embeds, noise, adapter.schedule(K, HEIGHT, WIDTH),
                               ["ode"] * K, 0.0, 2.5, batch_size=1)
    assert torch.equal(adapter.pack(traj["states"][:, -1]), expected)

    rows = edit_dataset.to_dict()
    source(9, (40, 24)).save(tmp_path / "wide.png")
    rows["source_image"][3] = str(tmp_path / "wide.png")
    config = kontext_config(FlowGRPOConfig, tmp_path, max_steps=1, source_image_size="output")
    trainer = FlowGRPOTrainer(config, tiny_flux_kontext_pipeline(), [brightness],
                              train_dataset=Dataset.from_dict(rows))
    assert trainer.adapter.source_size == "output"
    trainer.train()
    assert torch.isfinite(torch.tensor(trainer.state.log_history[-1]["loss"]))
    with pytest.raises(ValueError, match=r"source_image_size='output': FluxAdapter does not read it \(only editing "
                                         r"pipelines do\)"):
        FlowGRPOTrainer(kontext_config(FlowGRPOConfig, tmp_path, source_image_size="output"), tiny_flux_pipeline(),
                        [brightness], train_dataset=["a cat"])
    with pytest.raises(ValueError, match=r"source_image_size='output' in the config, but the FluxKontextAdapter was "
                                         r"built with source_size='source'"):
        FlowGRPOTrainer(config, make_adapter(), [brightness], train_dataset=edit_dataset)
    with pytest.raises(ValueError, match="source_image_size"):
        kontext_config(FlowGRPOConfig, tmp_path, source_image_size="big")
