"""Prompt encoding (trl_flow.engine.prompt_encoding): each distinct prompt (and source image) of a sampling chunk is
encoded once, and the samples' embeddings are bit for bit those of encoding every sample's prompt (the former path),
so one iteration's loss and updated LoRA weights are unchanged; the text encoders see P rows an iteration, not P x
G."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import PROMPTS, brightness, tiny_config
from PIL import Image

from trl_flow import FlowGRPOTrainer, editing
from trl_flow.models import cat_embeds


def former_encode(trainer, prompts, guidance_scale, columns=None):
    """The trainer's encode before the deduplication: every sample's prompt, in chunks of
    per_device_train_batch_size."""
    bs = trainer.config.per_device_train_batch_size
    parts = []
    with torch.no_grad(), trainer._autocast(), trainer.offloader.use("text_encoder"):
        for i in range(0, len(prompts), bs):
            images = editing.adapter_images(trainer.adapter, {k: v[i : i + bs] for k, v in (columns or {}).items()})
            parts.append(trainer.adapter.encode_prompts(prompts[i : i + bs], guidance_scale > 1,
                                                        trainer.config.max_sequence_length,
                                                        **({} if images is None else {"images": images})))
    return cat_embeds(parts)


def count_text_encoder_calls(pipe) -> dict[str, list[int]]:
    """{text encoder name: the batch size of each of its calls}, recorded by a forward pre-hook."""
    calls = {}
    for name, module in pipe.components.items():
        if name.startswith("text_encoder") and module is not None:
            calls[name] = []

            def hook(mod, args, kwargs, name=name):
                ids = kwargs.get("input_ids", args[0] if args else None)
                calls[name].append(int(ids.shape[0]))

            module.register_forward_pre_hook(hook, with_kwargs=True)
    return calls


def _assert_same(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].shape == b[k].shape and torch.equal(a[k], b[k]), k


def _sources(tmp_path, n):
    paths = []
    for i in range(n):
        a = np.random.default_rng(i).integers(0, 256, (32, 32, 3), dtype=np.uint8)
        paths.append(str(tmp_path / f"src{i}.png"))
        Image.fromarray(a).save(paths[-1])
    return paths


def _family(name, tmp_path):
    """(pipeline, train dataset, config overrides) of a family."""
    from trl_flow import testing

    if name == "sd3":  # with CFG: the negative prompt too
        return testing.tiny_sd3_pipeline(), PROMPTS, {"guidance_scale": 2.0}
    if name == "flux":
        return testing.tiny_flux_pipeline(), PROMPTS, {}
    if name == "qwen_image":  # pads to the longest prompt of a call: identical chunks are encoded once
        return testing.tiny_qwen_image_pipeline(), PROMPTS, {"per_device_train_batch_size": 2}
    from datasets import Dataset  # Kontext: one instruction on two sources, and a third row

    ds = Dataset.from_dict({"prompt": ["make it red", "make it red", "add a hat"],
                            "source_image": _sources(tmp_path, 3)})
    return testing.tiny_flux_kontext_pipeline(), ds, {"prompts_per_step": 3, "source_image_size": "output"}


@pytest.mark.parametrize("family", ["sd3", "flux", "kontext", "qwen_image"])
def test_embeddings_equal_the_former_path_and_each_prompt_is_encoded_once(tmp_path, family):
    pipe, ds, kw = _family(family, tmp_path)
    # by_prompt: the chunk counts below assume each prompt's G samples in G / B whole chunks (under the mixed layout
    # a longest-padding family encodes every distinct chunk; equality with the former path holds either way)
    config = tiny_config(tmp_path, **{"prompts_per_step": 4, "num_generations": 4, "batch_layout": "by_prompt", **kw})
    tr = FlowGRPOTrainer(config, pipe, [brightness], train_dataset=ds)
    calls = count_text_encoder_calls(pipe)
    prompts, columns, _ = tr.sample_prompts(0)
    new = tr.encode(prompts, config.guidance_scale, columns)
    new_calls = {name: list(c) for name, c in calls.items()}
    old = former_encode(tr, prompts, config.guidance_scale, columns)
    _assert_same(new, old)
    P, G, B = config.prompts_per_step, config.num_generations, config.per_device_train_batch_size
    assert len(prompts) == P * G
    branches = 2 if family == "sd3" else 1  # calls per chunk of each text encoder: the prompt's (and the negative's)
    for name, c in calls.items():
        assert c[len(new_calls[name]):] == [B] * (P * G // B) * branches, name  # the former path: every chunk
        if family == "qwen_image":  # one call per distinct chunk: G / B = 2 chunks of each prompt, one encoded
            assert new_calls[name] == [B] * P * branches, name
        else:  # the distinct (prompt, source) rows in calls of B rows: Kontext's 3 rows (not 2) in one call of 4
            assert new_calls[name] == [B] * math.ceil(P / B) * branches, name


def test_chunks_that_split_a_group_keep_the_former_values(tmp_path, fresh_pipe):
    """num_generations=3, per_device_train_batch_size=2: the chunks [p0 p0] [p0 p1] [p1 p1] are encoded as one
    call [p0 p1] of the chunks' size, not 3; the values are the former ones."""
    config = tiny_config(tmp_path, prompts_per_step=2, num_generations=3, per_device_train_batch_size=2)
    pipe = fresh_pipe()
    tr = FlowGRPOTrainer(config, pipe, [brightness], train_dataset=PROMPTS)
    calls = count_text_encoder_calls(pipe)
    prompts, columns, _ = tr.sample_prompts(0)
    new = tr.encode(prompts, 1.0, columns)
    assert set(map(tuple, calls.values())) == {(2,)}  # p0 and p1 in one call of the chunks' size
    _assert_same(new, former_encode(tr, prompts, 1.0, columns))


def test_one_iteration_loss_and_lora_weights_equal_the_former_path(tmp_path, fresh_pipe):
    from peft import get_peft_model_state_dict

    def run(former: bool, out):
        pipe = fresh_pipe()
        config = tiny_config(tmp_path / out, max_steps=1, guidance_scale=2.0, learning_rate=1e-2)
        tr = FlowGRPOTrainer(config, pipe, [brightness], train_dataset=PROMPTS)
        if former:
            tr.encode = lambda prompts, gs, columns=None: former_encode(tr, prompts, gs, columns)
        calls = count_text_encoder_calls(pipe)
        metrics = tr.training_iteration(0)
        lora = get_peft_model_state_dict(tr.accelerator.unwrap_model(tr.model))
        return metrics, {k: v.detach().clone() for k, v in lora.items()}, calls, tr.last_rollout.embeds

    m_new, w_new, c_new, e_new = run(False, "new")
    m_old, w_old, c_old, e_old = run(True, "old")
    _assert_same(e_new, e_old)
    assert m_new["loss"] == m_old["loss"] and m_new["reward"] == m_old["reward"]
    _assert_same(w_new, w_old)
    assert any(not torch.equal(v, torch.zeros_like(v)) for k, v in w_new.items() if "lora_B" in k)  # it trained
    # 2 prompts x 4 generations in chunks of 4: 1 call of 4 rows (2 distinct, filled up) instead of 2, each for the
    # prompt and the negative (CFG)
    assert set(map(tuple, c_new.values())) == {(4, 4)} and set(map(tuple, c_old.values())) == {(4, 4, 4, 4)}
