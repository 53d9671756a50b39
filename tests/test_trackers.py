"""Rollout and eval samples reach the trackers: images with prompt/reward captions and reward histograms, read
back from what tensorboard and wandb (offline) wrote."""

from __future__ import annotations

import glob
import json
import struct

import pytest
import torch
from conftest import PROMPTS


def _counting_brightness():
    """brightness, remembering every (prompt, score) it returned."""
    seen = []

    def brightness(images, prompts, **kwargs):
        scores = images.mean(dim=(1, 2, 3)).tolist()
        seen.extend(zip(prompts, scores))
        return scores

    return brightness, seen


def test_tensorboard_gets_images_captions_and_reward_histograms(make_trainer, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import (
        HISTOGRAMS, IMAGES, TENSORS, EventAccumulator)

    reward, _ = _counting_brightness()
    out = tmp_path / "tb"
    tr = make_trainer(rewards=[reward], output_dir=str(out), report_to="tensorboard", run_name="run", max_steps=2,
                      log_images_steps=2, eval_steps=2, eval_dataset=PROMPTS[:2])
    tr.train()
    (events,) = glob.glob(str(out / "run" / "events.out.tfevents*"))
    acc = EventAccumulator(events, size_guidance={IMAGES: 0, HISTOGRAMS: 0, TENSORS: 0})
    acc.Reload()
    tags = acc.Tags()

    # Rollout histogram every logging step: count and mean are the iteration's gathered rewards.
    hist = acc.Histograms("hist/train/reward")
    assert [h.step for h in hist] == [1, 2]
    for h in hist:
        logged = next(e for e in tr.state.log_history if e["step"] == h.step and "reward" in e)
        assert h.histogram_value.num == tr.config.train_batch_size
        assert h.histogram_value.sum / h.histogram_value.num == pytest.approx(logged["reward"], rel=1e-5)
    assert [h.step for h in acc.Histograms("hist/train/rewards/brightness")] == [1, 2]
    evals = acc.Histograms("hist/eval/reward")
    assert [h.step for h in evals] == [0, 2] and all(h.histogram_value.num == 2 for h in evals)

    # Images: the rollout every log_images_steps (step 2 only), the evaluation at every evaluation.
    assert [e.step for e in acc.Images("images/train")] == [2]
    assert [e.step for e in acc.Images("images/eval")] == [0, 2]
    img = acc.Images("images/train")[0]
    assert img.height == 32 and img.width == 32 * tr.config.train_batch_size  # add_images packs the batch in a row
    # Captions: prompt and reward of every logged sample, in order.
    assert "images/train/captions/text_summary" in tags["tensors"]
    text = acc.Tensors("images/train/captions/text_summary")[0].tensor_proto.string_val[0].decode()
    ro = tr.last_rollout
    for i, prompt in enumerate(ro.prompts):
        assert f"{i}. {prompt} | reward {float(ro.rewards[i]):.4g}" in text

    # Scalars under train/ and eval/, as TRL's trainers log them; the JSONL log keeps the plain names.
    assert "train/reward" in tags["scalars"] and "train/loss" in tags["scalars"], tags["scalars"]
    assert "eval/reward" in tags["scalars"] and "reward" not in tags["scalars"]
    assert [e.step for e in acc.Scalars("train/reward")] == [1, 2]
    assert any("reward" in e and "train/reward" not in e for e in tr.state.log_history)
    # The samples/ grids carry their prompts and rewards in a caption file beside them, in grid order.
    lines = (out / "samples" / "train_step_2.txt").read_text().splitlines()
    assert len(lines) == tr.config.train_batch_size
    assert lines[0] == f"row 0, column 0: {ro.prompts[0]} | reward {float(ro.rewards[0]):.4g}"
    assert (out / "samples" / "train_step_2.png").exists() and (out / "samples" / "eval_step_2.txt").exists()


def _wandb_history(run_dir: str) -> list[dict]:
    """History rows of an offline wandb run, from its .wandb file (LevelDB-style log of protobuf Records)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(f"{run_dir}/run-*.wandb")
    data = open(path, "rb").read()
    block, pos, buf, rows = 32768, 7, b"", []  # 7-byte file header, then 32 KiB blocks of records
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            break
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last fragment of one
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            if rec.WhichOneof("record_type") == "history":
                rows.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in rec.history.item})
    return rows


def test_wandb_offline_gets_captioned_images_and_histograms(make_trainer, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    reward, _ = _counting_brightness()
    tr = make_trainer(rewards=[reward], output_dir=str(tmp_path / "out"), report_to="wandb", run_name="wb",
                      max_steps=1, log_images_steps=1)
    tr.train()
    import wandb

    wandb.teardown()  # wait for wandb's service to finish writing the run
    (run_dir,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*"))
    rows = [r for r in _wandb_history(run_dir) if r.get("_step") == 1]
    merged = {k: v for r in rows for k, v in r.items()}
    ro = tr.last_rollout
    assert merged["images/train/_type"] == "images/separated"
    assert merged["images/train/count"] == len(ro)
    assert merged["images/train/captions"] == [f"{p} | reward {float(r):.4g}" for p, r in zip(ro.prompts, ro.rewards)]
    files = merged["images/train/filenames"]
    assert len(files) == len(ro) and all(glob.glob(f"{run_dir}/files/{f}") for f in files)
    assert merged["hist/train/reward/_type"] == "histogram"
    assert sum(merged["hist/train/reward/values"]) == len(ro)
    assert merged["train/reward"] == pytest.approx(float(torch.nanmean(ro.rewards)))  # TRL's train/ prefix


def test_captions_name_every_reward_and_missing_scores():
    from trl_flow.engine.tracking import captions

    text = captions(["a cat", "a dog"], torch.tensor([0.5, float("nan")]),
                    {"pick": torch.tensor([0.25, float("nan")]), "ocr": torch.tensor([0.25, float("nan")])})
    assert text == ["a cat | reward 0.5 (pick 0.25, ocr 0.25)", "a dog | reward nan (pick nan, ocr nan)"]


def test_tensorboard_gets_video_frame_strips(tmp_path):
    """A video pipeline's rollout reaches tensorboard as one frame strip per sample (B, 3, H, F' * W)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import IMAGES, EventAccumulator

    from trl_flow import FlowGRPOConfig, FlowGRPOTrainer
    from trl_flow.testing import tiny_wan_pipeline
    from trl_flow.video import per_frame

    def brightness(images, prompts, **kw):
        return images.mean(dim=(1, 2, 3)).tolist()

    out = tmp_path / "tbv"
    cfg = FlowGRPOConfig(output_dir=str(out), report_to="tensorboard", run_name="run", max_steps=1,
                         log_images_steps=1, num_generations=2, prompts_per_step=1, per_device_train_batch_size=2,
                         height=16, width=16, num_frames=5, num_inference_steps=3, guidance_scale=1.0,
                         max_sequence_length=8, lora_r=2, lora_alpha=2, beta=0.0, disable_tqdm=True)
    tr = FlowGRPOTrainer(cfg, tiny_wan_pipeline(scheduler="flow_match"), [per_frame(brightness)],
                         train_dataset=["a cat"])
    tr.train()
    (events,) = glob.glob(str(out / "run" / "events.out.tfevents*"))
    acc = EventAccumulator(events, size_guidance={IMAGES: 0})
    acc.Reload()
    (img,) = acc.Images("images/train")
    assert tr.last_rollout.images.shape[:2] == (2, 5)
    assert img.height == 16 and img.width == 16 * 5 * 2  # 5 frames side by side, 2 samples in a row
