"""``precompute_prompt_embeds``: a dataset with its prompts' embeddings stored, saved and loaded, trains a pipeline
whose text encoders are removed, bit for bit as the pipeline with them; mismatched settings are refused."""

from __future__ import annotations

import datasets
import pytest
import torch

from trl_flow import FlowGRPOConfig, FlowGRPOTrainer, precompute_prompt_embeds
from trl_flow.engine.stored_embeds import PREFIX, SETTINGS_COLUMN
from trl_flow.tasks import shapes
from trl_flow.tasks.shapes import grammar, model

PROMPTS = grammar.train_prompts()["prompt"][:4]
EVAL = grammar.test_prompts()["prompt"][:4]
VOLATILE = ("time/", "throughput/")


def _config(tmp_path, name, **kw):
    kw = {**dict(output_dir=str(tmp_path / name), height=32, width=32, max_steps=2, num_inference_steps=4,
                 num_generations=4, prompts_per_step=2, per_device_train_batch_size=4, eval_num_inference_steps=3,
                 per_device_eval_batch_size=4, max_sequence_length=model.MAX_SEQUENCE_LENGTH,
                 guidance_scale=model.DEFAULT_GUIDANCE_SCALE, disable_tqdm=True), **kw}
    return FlowGRPOConfig(**kw)


def _no_encoders(pipe):
    pipe.text_encoder = pipe.text_encoder_2 = None
    return pipe


def test_stored_embeds_train_bit_for_bit_without_text_encoders(tmp_path):
    config = _config(tmp_path, "ref")
    pipe = model.load_base_pipeline()
    train = precompute_prompt_embeds(pipe, list(PROMPTS), config=config)
    evalset = precompute_prompt_embeds(pipe, list(EVAL), config=config)
    assert train["prompt"] == list(PROMPTS) and SETTINGS_COLUMN in train.column_names
    train.save_to_disk(str(tmp_path / "train_ds"))
    train = datasets.load_from_disk(str(tmp_path / "train_ds"))

    ref = FlowGRPOTrainer(config, pipe, [shapes.shapes_partial_reward], train_dataset=list(PROMPTS),
                          eval_dataset=list(EVAL))
    emb = ref.encode(list(PROMPTS) + list(EVAL), config.guidance_scale)  # two full chunks of 4 (SD3 pooled CLIP)
    cols = [c for c in train.column_names if c.startswith(PREFIX) and c != SETTINGS_COLUMN]
    stored = {c[len(PREFIX):]: torch.cat([torch.as_tensor(d.with_format("numpy")[:][c]) for d in (train, evalset)])
              for c in cols}
    assert stored.keys() == emb.keys() and all(torch.equal(stored[k], emb[k]) for k in emb)
    ref.train()
    ref_eval = ref.evaluate()

    bare = FlowGRPOTrainer(_config(tmp_path, "bare"), _no_encoders(model.load_base_pipeline()),
                           [shapes.shapes_partial_reward], train_dataset=train, eval_dataset=evalset)
    assert bare.train_dataset.column_names == ["prompt"]  # the rewards never see the embedding columns
    bare.train()
    for a, b in zip(ref.state.log_history, bare.state.log_history, strict=True):
        keys = [k for k in a if not k.startswith(VOLATILE) and k != "calls/text_encoder"]
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
        assert a["calls/text_encoder"] > 0 and b["calls/text_encoder"] == 0
    assert bare.evaluate() == ref_eval and torch.equal(bare.last_eval_images, ref.last_eval_images)


def test_mismatched_or_missing_embeddings_are_refused(tmp_path):
    pipe = model.load_base_pipeline()
    config = _config(tmp_path, "a")
    ds = precompute_prompt_embeds(pipe, list(PROMPTS), config=config)
    reward = [shapes.shapes_partial_reward]
    for change, words in (({"max_sequence_length": 2}, "max_sequence_length=1"),
                          ({"guidance_scale": 1.0}, "guidance=True"),
                          ({"per_device_train_batch_size": 2}, "batch_size=4")):
        with pytest.raises(ValueError, match=f"train_dataset: .*{words}.*precompute_prompt_embeds"):
            FlowGRPOTrainer(_config(tmp_path, "b", **change), _no_encoders(model.load_base_pipeline()), reward,
                            train_dataset=ds)
    from trl_flow.testing import tiny_sd3_pipeline

    with pytest.raises(ValueError, match="transformer=.*another model"):  # another SD3 model, encoders removed
        FlowGRPOTrainer(_config(tmp_path, "c"), _no_encoders(tiny_sd3_pipeline()), reward, train_dataset=ds)
    other = model.load_base_pipeline()
    other.text_encoder_2 = None  # other encoders than at precompute: refused
    with pytest.raises(ValueError, match="text_encoders=.*differ"):
        FlowGRPOTrainer(_config(tmp_path, "c2"), other, reward, train_dataset=ds)
    with pytest.raises(ValueError, match="eval_dataset: the pipeline has no text encoders.*precompute_prompt_embeds"):
        FlowGRPOTrainer(_config(tmp_path, "d"), _no_encoders(model.load_base_pipeline()), reward, train_dataset=ds,
                        eval_dataset=list(EVAL))
    with pytest.raises(ValueError, match="train_dataset: the pipeline has no text encoders"):
        FlowGRPOTrainer(_config(tmp_path, "e"), _no_encoders(model.load_base_pipeline()), reward,
                        train_dataset=list(PROMPTS))
    with pytest.raises(ValueError, match="no text encoder"):
        precompute_prompt_embeds(_no_encoders(model.load_base_pipeline()), list(PROMPTS), config=config)
    with pytest.raises(ValueError, match="batch_size is required"):
        precompute_prompt_embeds(pipe, list(PROMPTS), guidance_scale=3.0, max_sequence_length=1)


def test_other_family_stored_rows_equal_the_trainers(tmp_path):
    """FLUX.1 (T5 + CLIP, distilled guidance): the stored rows are the trainer's encodings bit for bit."""
    from trl_flow.testing import tiny_flux_pipeline

    config = _config(tmp_path, "flux", max_sequence_length=8, guidance_scale=3.5, per_device_train_batch_size=2)
    pipe = tiny_flux_pipeline()
    ds = precompute_prompt_embeds(pipe, list(PROMPTS), config=config)
    trainer = FlowGRPOTrainer(config, tiny_flux_pipeline(), [shapes.shapes_partial_reward], train_dataset=ds)
    calls = []
    encode_prompts = trainer.adapter.encode_prompts
    trainer.adapter.encode_prompts = lambda *a, **k: calls.append(a) or encode_prompts(*a, **k)
    emb = trainer.encode(list(PROMPTS)[:2], config.guidance_scale)
    assert calls == []  # served from the stored rows
    trainer._stored_embeds = None
    ref = trainer.encode(list(PROMPTS)[:2], config.guidance_scale)
    assert len(calls) == 1 and emb.keys() == ref.keys() and all(torch.equal(emb[k], ref[k]) for k in ref)

    runs = []
    for name, pipe, data in (("with", tiny_flux_pipeline(), list(PROMPTS)),
                             ("without", tiny_flux_pipeline(), ds)):
        if name == "without":
            pipe.text_encoder = pipe.text_encoder_2 = None
        trainer = FlowGRPOTrainer(_config(tmp_path, f"flux_{name}", max_sequence_length=8, guidance_scale=3.5,
                                          per_device_train_batch_size=2), pipe, [shapes.shapes_partial_reward],
                                  train_dataset=data)
        trainer.train()
        runs.append([{k: v for k, v in e.items() if not k.startswith(VOLATILE) and k != "calls/text_encoder"}
                     for e in trainer.state.log_history])
    assert runs[0] == runs[1]  # FLUX.1 trains bit for bit without its encoders


def test_cli_precompute_embeds_then_train(tmp_path, capsys):
    from trl_flow import cli

    args = ["--model_name_or_path", "shapes", "--dataset_name", "shapes", "--height", "32", "--width", "32",
            "--num_generations", "4", "--prompts_per_step", "2", "--per_device_train_batch_size", "4",
            "--num_inference_steps", "4", "--disable_tqdm", "True"]
    assert cli.main(["precompute-embeds", "grpo", *args, "--output_dir", str(tmp_path / "emb")]) == 0
    folder = tmp_path / "emb" / "prompt_embeds" / "train"
    assert f"wrote {folder}" in capsys.readouterr().out
    trainer = cli.run("grpo", [*args, "--dataset_name", str(folder), "--reward_funcs", "shapes_partial",
                               "--max_steps", "1", "--output_dir", str(tmp_path / "run")])
    assert trainer.state.log_history[0]["calls/text_encoder"] == 0  # every prompt from the saved rows
    assert cli.main(["precompute-embeds", "grpo", *args, "--output_dir", str(tmp_path / "emb")]) == 2  # exists
    assert cli.main(["precompute-embeds", "--dataset_name", "x"]) == 2


@pytest.fixture
def fresh_accelerate_state():
    """accelerate keeps one AcceleratorState per process and refuses a second mixed-precision setting."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def test_bf16_stored_rows_equal_the_trainers(tmp_path, fresh_accelerate_state):
    """bf16: the precompute casts the encoders and encodes under autocast as the trainer does, then restores them."""
    config = _config(tmp_path, "bf16", bf16=True)
    pipe = model.load_base_pipeline()
    ds = precompute_prompt_embeds(pipe, list(PROMPTS), config=config)
    assert pipe.text_encoder.dtype == pipe.text_encoder_2.dtype == torch.float32
    trainer = FlowGRPOTrainer(config, pipe, [shapes.shapes_partial_reward], train_dataset=list(PROMPTS))
    emb = trainer.encode(list(PROMPTS), config.guidance_scale)
    rows = ds.with_format("numpy")[:]
    for k, v in emb.items():
        assert v.dtype == torch.bfloat16 and torch.equal(torch.as_tensor(rows[PREFIX + k]).to(v.dtype), v)
