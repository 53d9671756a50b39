"""The example scripts run end to end through their real loading code, on a tiny pipeline saved to disk."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(path):
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], os.path.join(ROOT, path))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses with postponed annotations look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def saved_pipeline(tmp_path_factory):
    from trl_flow.testing import tiny_sd3_pipeline

    path = tmp_path_factory.mktemp("tiny_sd3")
    tiny_sd3_pipeline().save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("method", ["flow_grpo", "op_grpo"])
def test_train_script_loads_a_saved_pipeline_and_writes_a_loadable_lora(tmp_path, saved_pipeline, method):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\na dog\n\na red circle\n")
    out = tmp_path / "out"
    train = _load("examples/train.py")
    trainer = train.main([
        "--method", method, "--model_name_or_path", saved_pipeline, "--dataset", str(prompts),
        "--reward", "jpeg_incompressibility", "--output_dir", str(out), "--max_steps", "2",
        "--height", "32", "--width", "32", "--num_inference_steps", "4", "--max_sequence_length", "16",
        "--num_generations", "2", "--prompts_per_step", "4", "--per_device_train_batch_size", "4",
        "--lora_r", "4", "--lora_alpha", "8", "--disable_tqdm", "true",
    ])
    assert trainer.state.global_step == 2
    assert len(trainer.train_dataset) == 3  # the empty line is skipped
    assert os.path.exists(out / "pytorch_lora_weights.safetensors")
    from trl_flow.models import load_pipeline

    pipe = load_pipeline(saved_pipeline)
    pipe.load_lora_weights(str(out))
    gen = torch.Generator().manual_seed(0)
    img = pipe("a cat", height=32, width=32, num_inference_steps=2, max_sequence_length=16, generator=gen,
               output_type="pt").images
    assert img.shape == (1, 3, 32, 32) and torch.isfinite(img).all()


def test_train_script_rejects_an_unknown_reward(saved_pipeline, tmp_path):
    train = _load("examples/train.py")
    with pytest.raises(ValueError, match="--reward"):
        train.main(["--model_name_or_path", saved_pipeline, "--dataset", "shapes", "--reward", "nope",
                    "--output_dir", str(tmp_path), "--height", "32", "--width", "32"])


def test_load_pipeline_rejects_an_unsupported_family(tmp_path):
    from trl_flow.models import get_adapter

    with pytest.raises(TypeError, match="pipe: no trl_flow adapter"):
        get_adapter(object())


def test_prompt_loaders_read_the_real_prompt_sets():
    from trl_flow.data import load_prompts

    shared = os.path.join(ROOT, "..", "shared", "data", "prompt-sets")
    geneval = os.path.join(shared, "geneval", "test_metadata.jsonl")
    ocr = os.path.join(shared, "ocr", "test.txt")
    if not (os.path.exists(geneval) and os.path.exists(ocr)):
        pytest.skip("../shared/data/prompt-sets not present")
    ds = load_prompts(geneval)
    assert len(ds) > 2000 and {"prompt", "tag", "include"} <= set(ds.column_names)
    row = ds[1]
    assert row["tag"] == "color_attr" and json.loads(row["include"])[0]["class"] == "handbag"
    txt = load_prompts(ocr)
    assert len(txt) > 1000 and all('"' in p for p in txt["prompt"][:20])


def test_quickstart_writes_lora_labelled_grid_and_scores(tmp_path):
    """The README's main job, one iteration: LoRA, the labelled before/after sheet and the scores file."""
    from PIL import Image

    quickstart = _load("examples/quickstart.py")
    out = tmp_path / "qs"
    quickstart.main(["--steps", "1", "--images_per_prompt", "1", "--output_dir", str(out)])
    assert (out / "pytorch_lora_weights.safetensors").stat().st_size > 1000
    scores = json.loads((out / "scores.json").read_text())
    for split in ("trained_prompts", "held_out_prompts"):
        for when in ("before", "after"):
            o = scores[split][when]["overall"]
            assert 0 <= o["strict"] <= o["partial"] <= 1
    sheet = Image.open(out / "before_after.png")
    n_prompts = len(quickstart.TRAIN_PROMPTS)
    assert sheet.size[1] == 40 + n_prompts * 68  # one labelled row per trained prompt, all
    assert scores["run"]["steps"] == 1 and scores["run"]["threads"] == 1 and scores["run"]["train_cpu_s"] > 0
    assert "Measured here with seed 0 (1 iterations" in quickstart.readme_summary(scores)
