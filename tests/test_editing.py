"""Image editing infrastructure: the source-image column (checks, lazy decoding, .jsonl files), the adapter hook
(conditioning="text_and_image"; text-to-image pipelines refuse a source column), rewards that receive the source
(edit_preservation, the VLM judge's edit messages)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import HEIGHT, WIDTH
from PIL import Image

from trl_flow import editing
from trl_flow.data import load_prompts


def _rgb(seed, w=8, h=6):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


# ------------------------------------------------------------------------------------------------------- data
def test_jsonl_source_paths_resolve_against_the_files_folder(tmp_path, monkeypatch):
    (tmp_path / "data" / "img").mkdir(parents=True)
    Image.fromarray(_rgb(0)).save(tmp_path / "data" / "img" / "a.png")
    Image.fromarray(_rgb(1)).save(tmp_path / "b.png")
    lines = [{"prompt": "make it red", "source_image": "img/a.png", "tag": 1},
             {"prompt": "add a hat", "source_image": str(tmp_path / "b.png"), "tag": 2}]
    path = tmp_path / "data" / "edits.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    monkeypatch.chdir(tmp_path)  # another working directory: the relative path is still the file's
    ds = load_prompts(str(path))
    assert ds["source_image"] == [str(tmp_path / "data" / "img" / "a.png"), str(tmp_path / "b.png")]
    assert ds["tag"] == [1, 2]
    editing.check_sources(ds, "source_image")
    assert np.array_equal(np.asarray(editing.load_source(ds["source_image"][0], 0, "source_image")), _rgb(0))


def test_jsonl_source_of_another_kind_is_named(tmp_path):
    path = tmp_path / "edits.jsonl"
    path.write_text('{"prompt": "a", "source_image": 3}\n')
    with pytest.raises(ValueError, match=r"edits.jsonl: key `source_image` must hold image paths \(strings\)"):
        load_prompts(str(path))


def test_every_value_form_decodes_to_the_same_rgb_image(tmp_path):
    """Paths, PIL images (RGB, RGBA, P), uint8 arrays (H, W, 3), float arrays / tensors (3, H, W) in [0, 1], and a
    datasets.Image column all give one RGB PIL image."""
    from datasets import Dataset
    from datasets import Image as ImageFeature

    a = _rgb(3)
    Image.fromarray(a).save(tmp_path / "x.png")
    values = [str(tmp_path / "x.png"), Image.fromarray(a), Image.fromarray(a).convert("RGBA"), a, a.tolist(),
              torch.from_numpy(a).permute(2, 0, 1).float() / 255, a.transpose(2, 0, 1).astype(np.float64) / 255]
    for i, v in enumerate(values):
        im = editing.load_source(v, i, "source_image")
        assert im.mode == "RGB" and np.array_equal(np.asarray(im), a), i
    ds = Dataset.from_dict({"prompt": ["p"], "source_image": [str(tmp_path / "x.png")]}).cast_column(
        "source_image", ImageFeature())
    editing.check_sources(ds, "source_image")
    assert np.array_equal(np.asarray(editing.load_source(ds[0]["source_image"], 0, "source_image")), a)


@pytest.mark.parametrize("value,match", [
    ("missing", r"image file '.*nope.png' not found"),
    ("garbage", r"'.*g.png' is not a readable image"),
    (None, r"no source image \(None\)"),
    (np.zeros((4, 5, 2), np.uint8),
     r"an image array must be \(H, W, 3\), \(3, H, W\) or \(H, W\), got shape \(4, 5, 2\)"),
    (Image.new("F", (4, 4)), r"PIL image of mode 'F'"),
])
def test_bad_sources_name_the_dataset_row_and_column(tmp_path, value, match):
    from datasets import Dataset

    if isinstance(value, str) and value == "missing":
        value = str(tmp_path / "nope.png")
    elif isinstance(value, str) and value == "garbage":
        (tmp_path / "g.png").write_bytes(b"\x89PNG but not really")
        value = str(tmp_path / "g.png")
    good = str(tmp_path / "ok.png")
    Image.fromarray(_rgb(0)).save(good)
    rows = [good, good, value]
    with pytest.raises(ValueError, match=r"^eval_dataset: row 2, column `src`: " + match) as e:
        if isinstance(value, (str, type(None))):
            editing.check_sources(Dataset.from_dict({"prompt": ["a", "b", "c"], "src": rows}), "src", "eval_dataset")
        else:  # in-memory values are checked where they are (arrow would convert them)
            editing._check_value(value, editing._where("eval_dataset", 2, "src"))
    assert "\n" not in str(e.value)


def test_a_missing_datasets_image_file_is_refused(tmp_path):
    from datasets import Dataset
    from datasets import Image as ImageFeature

    Image.fromarray(_rgb(0)).save(tmp_path / "a.png")
    ds = Dataset.from_dict({"prompt": ["a", "b"], "source_image": [str(tmp_path / "a.png"), str(tmp_path / "a.png")]})
    ds = ds.cast_column("source_image", ImageFeature())
    (tmp_path / "a.png").unlink()
    ds.cast_column("source_image", ImageFeature(decode=False))  # the column holds paths only, nothing decoded
    with pytest.raises(ValueError, match=r"train_dataset: row 0, column `source_image`: image file .* not found"):
        editing.check_sources(ds, "source_image")


def test_float_arrays_out_of_range_are_refused_when_decoded():
    with pytest.raises(ValueError, match=r"row 4, column `source_image`: an image array must be integers in "
                                         r"\[0, 255\] or floats in \[0, 1\], got float32 in \[0.0, 2.0\]"):
        bad = np.full((3, 4, 4), 2.0, np.float32)
        bad[0, 0, 0] = 0.0
        editing.load_source(bad, 4, "source_image")
    with pytest.raises(ValueError, match=r"got int64 in \[-1, 3\]"):
        editing.load_source(np.array([[[-1, 3, 0]]]), 4, "source_image")


def test_source_tensor_is_the_generated_size_in_unit_range():
    a = _rgb(5, w=8, h=8)
    t = editing.source_tensor([Image.fromarray(a), Image.fromarray(_rgb(6, w=20, h=10))], 8, 8)
    assert t.shape == (2, 3, 8, 8) and t.dtype == torch.float32 and 0 <= t.min() and t.max() <= 1
    assert torch.equal(t[0], torch.from_numpy(a).permute(2, 0, 1).float() / 255)  # same size: not resampled


# -------------------------------------------------------------------------------------------------- the hook
def test_text_to_image_pipeline_refuses_a_source_column(tmp_path):
    """A text-to-image pipeline given an editing dataset would learn edit instructions as prompts: refused,
    naming the column and both fixes, before any compute."""
    from datasets import Dataset

    from trl_flow import FlowGRPOConfig, FlowGRPOTrainer
    from trl_flow.testing import tiny_flux_pipeline

    Image.fromarray(_rgb(0)).save(tmp_path / "a.png")
    ds = Dataset.from_dict({"prompt": ["make it red"], "source_image": [str(tmp_path / "a.png")]})
    calls = []
    config = FlowGRPOConfig(output_dir=str(tmp_path / "o"), height=HEIGHT, width=WIDTH, num_generations=2,
                            prompts_per_step=1, per_device_train_batch_size=2, max_sequence_length=16)
    with pytest.raises(ValueError, match=r"train_dataset: has a `source_image` column, but FluxAdapter generates "
                                         r"from text alone .*FluxKontextPipeline.*remove_columns"):
        FlowGRPOTrainer(config, tiny_flux_pipeline(), [lambda im, p, **k: calls.append(1) or [0.0] * len(p)],
                        train_dataset=ds)
    assert calls == []


def test_adapter_images_decode_each_path_once_and_text_adapters_get_none(tmp_path, monkeypatch):
    from trl_flow.models import FlowAdapter

    class Editing(FlowAdapter):
        conditioning = "text_and_image"
        source_column = "src"

    Image.fromarray(_rgb(0)).save(tmp_path / "a.png")
    Image.fromarray(_rgb(1)).save(tmp_path / "b.png")
    paths = [str(tmp_path / n) for n in ("a.png", "a.png", "b.png", "a.png")]
    decoded = []
    load = editing.load_source
    monkeypatch.setattr(editing, "load_source", lambda v, *a, **k: decoded.append(v) or load(v, *a, **k))
    images = editing.adapter_images(Editing(None), {"src": paths, "other": [1, 2, 3, 4]})
    assert decoded == [paths[0], paths[2]] and images[0] is images[1] is images[3]
    assert np.array_equal(np.asarray(images[2]), _rgb(1))
    assert editing.adapter_images(FlowAdapter(None), {"src": paths}) is None
    with pytest.raises(ValueError, match=r"Editing needs the `src` column"):
        editing.adapter_images(Editing(None), {"other": [1]})
    cols = editing.reward_columns(Editing(None), {"src": paths, "other": [1, 2, 3, 4]}, 6, 8)
    assert set(cols) == {"source_image", "other"} and cols["source_image"].shape == (4, 3, 6, 8)


def test_compute_rewards_passes_a_tensor_column_as_a_tensor():
    """The reward contract: source_image arrives as (B, 3, H, W) float32 (a copy per reward), not a list."""
    from trl_flow.rewards import compute_rewards

    got = []

    def reward(images, prompts, source_image=None, **columns):
        got.append(source_image)
        source_image.zero_()  # a reward that writes into it must not affect another reward
        return [1.0] * len(prompts)

    src = torch.rand(2, 3, 4, 4)
    compute_rewards([reward, reward], ["a", "b"], [1.0, 1.0], torch.rand(2, 3, 4, 4), ["p", "q"],
                    {"source_image": src, "k": [1, 2]})
    assert all(isinstance(g, torch.Tensor) and g.shape == (2, 3, 4, 4) for g in got)
    assert got[0] is not got[1] and src.sum() > 0


# ---------------------------------------------------------------------------------------------------- rewards
def test_edit_preservation_on_constructed_images():
    """d = per-pixel mean |G - S| over channels; the edit_fraction most-changed pixels are the edited region; the
    reward is 1 - mean(d) over the rest."""
    from trl_flow.rewards import get_reward

    reward = get_reward("edit_preservation")  # edit_fraction 0.25
    src = torch.rand(1, 3, 20, 20, generator=torch.Generator().manual_seed(0))
    same = src.clone()
    square = src.clone()
    square[:, :, :6, :6] = 1 - square[:, :, :6, :6]  # 36 of 400 pixels (9 %) changed completely: inside 25 %
    shifted = (src + 0.2).clamp(max=1.0)
    base = torch.full((1, 3, 20, 20), 0.3)
    half = base.clone()
    half[:, :, :10] = 1.0  # 50 % of the pixels change by 0.7: the 25 % allowed, then 25 % of the 75 % kept
    images = torch.cat([same, square, base, half])
    sources = torch.cat([src, src, base, base])
    r = reward(images, ["p"] * 4, source_image=sources)
    assert r[:3] == [1.0, 1.0, 1.0]
    assert r[3] == pytest.approx(1 - 0.7 * (100 / 300), abs=1e-6)
    d = (shifted - src).abs().mean(dim=1).flatten()  # every pixel changed: the 300 least-changed are scored
    assert reward(shifted, ["p"], source_image=src)[0] == pytest.approx(1 - float(d.sort().values[:300].mean()),
                                                                         abs=1e-6)
    whole = get_reward("edit_preservation", edit_fraction=0.0)
    assert whole(square, ["p"], source_image=src)[0] == pytest.approx(
        1 - float((square - src).abs().mean()), abs=1e-6)
    assert whole(square, ["p"], source_image=src)[0] < 0.99


def test_edit_preservation_refuses_missing_or_mismatched_sources():
    from trl_flow.rewards import edit_preservation

    with pytest.raises(ValueError, match="needs source_image"):
        edit_preservation()(torch.rand(1, 3, 4, 4), ["p"])
    with pytest.raises(ValueError, match=r"images \(1, 3, 4, 4\) and source_image \(1, 3, 8, 8\)"):
        edit_preservation()(torch.rand(1, 3, 4, 4), ["p"], source_image=torch.rand(1, 3, 8, 8))
    with pytest.raises(ValueError, match=r"edit_fraction=1"):
        edit_preservation(edit_fraction=1)


def test_vlm_judge_sends_the_source_before_the_edit():
    """With source_image the judge's message holds two images, the source first, then the rubric text."""
    from trl_flow.rewards import EDIT_RUBRIC, VLMJudgeReward
    from trl_flow.rewards.wire import encode_images

    judge = VLMJudgeReward("http://127.0.0.1:9/v1", model="m", rubric=EDIT_RUBRIC)
    sent = []
    judge._ask = lambda image, prompt, row, source=None: sent.append(
        judge.messages(image, prompt, row, source)) or (1.0, "Score: 10")
    images, sources = torch.rand(2, 3, 4, 4), torch.rand(2, 3, 4, 4)
    assert judge(images, ["make it red", "add a hat"], source_image=sources, tag=[1, 2]) == [1.0, 1.0]
    content = sent[0][0]["content"]
    assert [c["type"] for c in content] == ["image_url", "image_url", "text"]
    assert content[0]["image_url"]["url"].endswith(encode_images(sources[:1])[0])
    assert content[1]["image_url"]["url"].endswith(encode_images(images[:1])[0])
    assert content[2]["text"].endswith("Instruction: make it red")


def test_docs_quote_the_edit_rubric():
    import os

    from trl_flow.rewards import EDIT_RUBRIC

    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "rewards.md")) as f:
        quoted = " ".join(line[2:] for line in f.read().splitlines() if line.startswith("> "))
    assert " ".join(EDIT_RUBRIC.replace("\n", " ").split()) in " ".join(quoted.split())


def test_a_source_broken_after_set_up_is_named_by_its_path_when_decoded(tmp_path):
    from trl_flow.models import FlowAdapter

    class Editing(FlowAdapter):
        conditioning = "text_and_image"

    (tmp_path / "a.png").write_bytes(b"truncated")
    with pytest.raises(ValueError, match=r"^train_dataset: column `source_image`: '[^']*a.png' is not a readable "
                                         r"image \(UnidentifiedImageError\)$"):
        editing.adapter_images(Editing(None), {"source_image": [str(tmp_path / "a.png")]})
    Image.fromarray(_rgb(0, 64, 64)).save(tmp_path / "b.png")
    data = (tmp_path / "b.png").read_bytes()
    (tmp_path / "b.png").write_bytes(data[: len(data) // 2])  # the header reads, the pixels do not
    assert editing._check_value(str(tmp_path / "b.png"), "w") == (64, 64)
    with pytest.raises(ValueError,
                       match=r"^train_dataset: column `source_image`: cannot decode '[^']*b.png' \(OSError"):
        editing.adapter_images(Editing(None), {"source_image": [str(tmp_path / "b.png")]})
    with pytest.raises(ValueError, match=r"Editing needs the `source_image` column .* columns=\{'source_image'"):
        editing.adapter_images(Editing(None), {})
