"""The long-prompt warning: each family's adapter gives the token limit its pipeline cuts at and counts a prompt's
tokens as the pipeline does (chat templates, system messages, Qwen-Image's dropped prefix), so a too-long prompt warns
once, naming its dataset row and the limit, in every family (before, families without a T5 / CLIP tokenizer never
warned)."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import brightness, tiny_config

from trl_flow import FlowGRPOTrainer, testing
from trl_flow.models import get_adapter
from trl_flow.engine.guards import LongPromptWarning

MSL = 64
LONG = "a dog " * 40
ROWS = ["a cat", "a red dog", LONG, "green sky"]  # the long prompt is row 2

#: family -> (builder, the tokenizer whose limit the long prompt passes first, that limit at max_sequence_length=64)
FAMILIES = {
    "sd3": (testing.tiny_sd3_pipeline, "tokenizer", 16),  # CLIP: its model_max_length (16 in the tiny pipeline)
    "flux": (testing.tiny_flux_pipeline, "tokenizer", 16),
    "wan": (testing.tiny_wan_pipeline, "tokenizer", MSL),  # UMT5: max_sequence_length
    "qwen_image": (testing.tiny_qwen_image_pipeline, "tokenizer", MSL),  # Qwen2.5-VL
    "zimage": (testing.tiny_zimage_pipeline, "tokenizer", MSL),  # Qwen3, chat template
    "flux2": (testing.tiny_flux2_pipeline, "tokenizer", MSL),  # Mistral, chat with the system message
    "flux2_klein": (testing.tiny_flux2_klein_pipeline, "tokenizer", MSL),  # Qwen3, chat template
}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_too_long_prompt_warns_once_naming_its_row_and_the_limit(family):
    build, name, limit = FAMILIES[family]
    from datasets import Dataset

    guard = LongPromptWarning(get_adapter(build()), MSL, {"train_dataset": Dataset.from_dict({"prompt": ROWS})})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        guard.check(["a cat", "a cat", "a red dog", "green sky"])  # normal prompts: no warning
    with pytest.warns(UserWarning, match=rf"1 of 2 distinct prompts in this batch exceed the {limit}-token limit of "
                                         rf"pipe\.{name} and are cut there by the pipeline: e\.g\. train_dataset row "
                                         r"2, \d+ tokens: 'a dog a dog") as seen:
        guard.check([LONG, LONG, "a cat", "a cat"])
    raisable = limit == MSL  # T5 / chat-template limits follow max_sequence_length; CLIP's does not
    assert ("Shorten them or raise max_sequence_length." in str(seen[0].message)) == raisable
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        guard.check([LONG, LONG])  # reported once


@pytest.mark.parametrize("family", ["qwen_image", "zimage"])
def test_the_counted_tokens_are_those_the_pipeline_keeps(family):
    """Where the adapter stores the text mask, the kept tokens are min(counted, limit): the count is the pipeline's."""
    adapter = get_adapter(FAMILIES[family][0]())
    limit = adapter.prompt_token_limits(MSL)["tokenizer"]
    counts = adapter.prompt_token_counts(ROWS, "tokenizer")
    with torch.no_grad():
        embeds = adapter.encode_prompts(ROWS, False, MSL)
    mask = embeds["prompt_embeds_mask" if family == "qwen_image" else "prompt_mask"]
    assert mask.sum(dim=1).tolist() == [min(c, limit) for c in counts]
    assert counts[2] > limit >= max(counts[:2] + counts[3:])


def test_the_trainer_warns_once_naming_the_train_dataset_row(tmp_path, fresh_pipe):
    """Through the trainer (sampling encodes the iteration's prompts): one warning over two iterations, naming the
    row of train_dataset, and the pipeline's own truncation message (repeated at every encode) silenced."""
    config = tiny_config(tmp_path, max_steps=2, prompts_per_step=2, num_generations=2, per_device_train_batch_size=2)
    tr = FlowGRPOTrainer(config, fresh_pipe(), [brightness], train_dataset=["a cat", LONG])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        tr.train()
    ours = [str(w.message) for w in seen if "token limit" in str(w.message)]
    assert len(ours) == 1 and "16-token limit of pipe.tokenizer" in ours[0] and "train_dataset row 1" in ours[0]
    assert "Reported once per trainer" in ours[0] and "does not change with max_sequence_length" in ours[0]


def test_the_warning_points_at_the_users_code(tmp_path, fresh_pipe):
    """Reached through the trainer's ``encode`` (wrapped by ``torch.no_grad``), the warning names the line of the
    user's code that called it, not torch/utils/_contextlib.py or a trl_flow file."""
    trainer = FlowGRPOTrainer(tiny_config(tmp_path), fresh_pipe(), [brightness], train_dataset=ROWS)
    with pytest.warns(UserWarning, match="exceed the 16-token limit") as seen:
        trainer.encode([LONG, "a cat"], guidance_scale=1.0)
    assert seen[0].filename == __file__, seen[0].filename
