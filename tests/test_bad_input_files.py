"""Bad prompt files, recipes and flags ("bad input that fails late or unclearly"): each is
one line naming the file / line / field and the fix, raised before the pipeline is loaded, through every entry
point (``trl_flow.data.load_prompts``, ``trl-flow``, ``examples/train.py``, the trainer's constructor)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys

import pytest
from conftest import brightness, tiny_config

from trl_flow import FlowGRPOConfig, FlowGRPOTrainer, cli
from trl_flow.data import check_prompt_dataset, load_prompts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _example_main():
    spec = importlib.util.spec_from_file_location("train_example", os.path.join(ROOT, "examples", "train.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod.main


def _short(message: str) -> str:
    assert "\n" not in message and "Traceback" not in message and len(message) < 400, message
    return message


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("trl-flow ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return _short(lines[0])


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if the command line gets as far as loading the pipeline."""
    monkeypatch.setattr(cli, "_load_pipeline", lambda *a: pytest.fail("the pipeline was loaded"))


# ------------------------------------------------------------------------------------------------ prompt files
_ROWS_299 = "".join(json.dumps({"prompt": f"prompt {i}"}) + "\n" for i in range(299))

FILES = [  # (id, file name, content, what the error must say besides the file's path)
    ("latin1_txt", "p.txt", "a cat\na caf\xe9\n".encode("latin-1"), r"line 2 is not UTF-8 .*save the file as UTF-8"),
    ("latin1_jsonl", "p.jsonl", '{"prompt": "a caf\xe9"}\n'.encode("latin-1"), r"line 1 is not UTF-8"),
    ("bad_json_line_300", "p.jsonl", (_ROWS_299 + '{"prompt": "x", "tag": }\n').encode(),
     r"line 300, column 24: invalid JSON .*one JSON object"),
    ("prompt_is_a_number", "p.jsonl", b'{"prompt": "a cat"}\n{"prompt": 5}\n',
     r"line 2: `prompt` is a number \(5\); each prompt must be one string"),
    ("prompt_is_a_list", "p.jsonl",
     b'{"prompt": "a cat", "n": 1}\n{"prompt": ["a", "dog"], "n": 2}\n{"prompt": "x"}\n',
     r"line 2: `prompt` is a list \(\[\"a\", \"dog\"\]\)"),
    ("prompt_is_an_object", "p.jsonl", b'{"prompt": {"text": "a cat", "tag": "animal"}}\n',
     r"line 1: `prompt` is an object"),
    ("prompt_is_null", "p.jsonl", b'{"prompt": "a cat"}\n\n{"prompt": null}\n', r"line 3: `prompt` is null \(null\)"),
    ("empty_prompt", "p.jsonl", b'{"prompt": "a cat"}\n{"prompt": "  "}\n', r"line 2: `prompt` is empty"),
    ("not_an_object", "p.jsonl", b'{"prompt": "a cat"}\n["a dog"]\n', r"line 2 is a list, not a JSON object"),
    ("no_prompt_key", "p.jsonl", b'{"prompt": "a cat"}\n{"text": "a dog"}\n', r"line 2 has no `prompt` key"),
    ("mixed_column", "p.jsonl", b'{"prompt": "a", "label": 1}\n{"prompt": "b"}\n{"prompt": "c", "label": "x"}\n',
     r"key `label` mixes types: line 1 has a number \(1\), line 3 has a string .*one type on every line"),
    ("nested_among_strings", "p.jsonl", b'{"prompt": "a", "tag": "x"}\n{"prompt": "b", "tag": {"k": 1}}\n',
     r"key `tag` mixes types: line 1 has a string .*line 2 has an object"),
]


@pytest.mark.parametrize("entry", ["load_prompts", "trl-flow", "examples/train.py"])
@pytest.mark.parametrize("case", FILES, ids=[c[0] for c in FILES])
def test_a_bad_prompt_file_is_one_line_naming_file_and_line_before_the_model(tmp_path, capsys, no_model, case, entry):
    _, name, content, expected = case
    path = tmp_path / name
    path.write_bytes(content)
    argv = ["--dataset_name", str(path), "--reward_funcs", "shapes_partial", "--output_dir", str(tmp_path / "out")]
    if entry == "load_prompts":
        with pytest.raises(ValueError) as info:
            load_prompts(str(path))
        message = _short(str(info.value))
    elif entry == "trl-flow":
        assert cli.main(["grpo", *argv]) == 2
        message = _one_error_line(capsys)
        assert "TRL_FLOW_TRACEBACK" not in message  # a ValueError: no "[ExceptionType; ...]" note
    else:
        with pytest.raises(ValueError) as info:
            _example_main()(argv)
        message = _short(str(info.value))
    assert f"{path}: " in message
    assert re.search(expected, message), message


def test_the_first_prompt_loses_a_utf8_bom(tmp_path):
    txt, jsonl = tmp_path / "p.txt", tmp_path / "p.jsonl"
    txt.write_bytes(b"\xef\xbb\xbfa cat\na dog\n")
    jsonl.write_bytes(b'\xef\xbb\xbf{"prompt": "a cat"}\n')
    assert load_prompts(str(txt))["prompt"] == ["a cat", "a dog"]
    assert load_prompts(str(jsonl))["prompt"] == ["a cat"]


def test_other_columns_keep_their_types_and_missing_values_are_none(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a cat", "n": 1, "tag": "animal", "include": [{"class": "cat"}]}\n'
                    '{"prompt": "a dog", "n": 2, "include": [{"class": "dog", "count": 2}], "exclude": {"class": '
                    '"cat"}}\n{"prompt": "a car"}\n')
    ds = load_prompts(str(path))
    assert ds["prompt"] == ["a cat", "a dog", "a car"]
    assert ds["n"] == [1, 2, None] and ds.features["n"].dtype == "int64"
    assert ds["tag"] == ["animal", None, None]
    # a key holding only lists / objects is their JSON text; a missing one is None, not the string "null"
    assert [json.loads(v) if v is not None else None for v in ds["include"]] == [
        [{"class": "cat"}], [{"class": "dog", "count": 2}], None]
    assert ds["exclude"] == [None, '{"class": "cat"}', None]


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"p\.txt: no such file"):
        load_prompts(str(tmp_path / "p.txt"))


# ---------------------------------------------------------------------------------------- Python API datasets
@pytest.mark.parametrize("columns,exc,expected", [
    ({"prompt": ["a cat", 5]}, ValueError, r"train_dataset: `prompt` must hold strings; row 1 is 5 \(int\)"),
    ({"prompt": ["a", "b"], "label": [1, "x"]}, ValueError, r"train_dataset: column `label` mixes value types"),
    ({"prompt": "a cat"}, TypeError, r"train_dataset: column `prompt` must be a list of values, got str"),
])
def test_a_dict_of_columns_with_bad_types_is_refused_naming_the_column(tmp_path, fresh_pipe, columns, exc, expected):
    with pytest.raises(exc, match=expected) as info:
        check_prompt_dataset(columns)
    _short(str(info.value))
    pipe = fresh_pipe()
    with pytest.raises(exc, match=expected):
        FlowGRPOTrainer(tiny_config(tmp_path), pipe, [brightness], train_dataset=columns)
    assert not getattr(pipe.transformer, "peft_config", None)  # before the model was touched


# ------------------------------------------------------------------------------------------------------ recipes
def test_a_yaml_syntax_error_names_file_line_and_column(tmp_path, capsys, no_model):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("max_steps: 3\nlearning_rate: [1e-4\nseed: 1\n")
    assert cli.main(["grpo", "--config", str(recipe), "--dataset_name", "shapes"]) == 2
    line = _one_error_line(capsys)
    assert f"--config {recipe}: YAML syntax error at line 3, column 5" in line
    assert "line 2, column 16" in line  # where the unclosed list started
    recipe.write_text("max_steps: 3\n  seed: 2\n")
    with pytest.raises(cli.CLIError, match=r"r\.yaml: YAML syntax error at line 2, column 7: mapping values"):
        cli.parse_args("grpo", ["--config", str(recipe)])
    recipe.write_bytes("max_steps: 3\n# caf\xe9\n".encode("latin-1"))
    with pytest.raises(cli.CLIError, match=r"r\.yaml: line 2 is not UTF-8"):
        cli.parse_args("grpo", ["--config", str(recipe)])
    recipe.write_text("- max_steps\n")
    with pytest.raises(cli.CLIError, match=r"r\.yaml: expected a YAML mapping"):
        cli.parse_args("grpo", ["--config", str(recipe)])


def test_a_single_value_for_a_list_field_is_a_one_item_list(tmp_path, monkeypatch):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("reward_funcs: shapes_partial\nreward_weights: 2.0\nlora_target_modules: attn.to_q\n")
    script, config, _ = cli.parse_args("grpo", ["--config", str(recipe)])
    assert script.reward_funcs == ["shapes_partial"]  # not read as its letters
    assert config.reward_weights == [2.0] and config.lora_target_modules == ["attn.to_q"]
    recipe.write_text("reward_funcs: shapes_partial\nreward_weights: ['2.0']\n")
    assert cli.parse_args("grpo", ["--config", str(recipe)])[1].reward_weights == [2.0]  # the field's type

    class Reached(Exception):
        pass

    def load_pipeline(script_args, config):
        raise Reached

    resolved = []
    monkeypatch.setattr(cli, "resolve_reward", lambda spec: resolved.append(spec) or brightness)
    monkeypatch.setattr(cli, "_load_pipeline", load_pipeline)
    with pytest.raises(Reached):  # the dataset loaded and the run got to the model, with one reward
        cli.run("grpo", ["--config", str(recipe), "--dataset_name", "shapes"])
    assert resolved == ["shapes_partial"]
    recipe.write_text("reward_weights: [1.0, x]\n")
    with pytest.raises(cli.CLIError, match=r"r\.yaml: reward_weights: invalid float value: 'x'"):
        cli.parse_args("grpo", ["--config", str(recipe)])
    recipe.write_text("reward_funcs: {shapes_partial: 1}\n")
    with pytest.raises(cli.CLIError, match=r"r\.yaml: reward_funcs: expected a value or a list of values"):
        cli.parse_args("grpo", ["--config", str(recipe)])


# ------------------------------------------------------------------------------------------------------- flags
@pytest.mark.parametrize("flag,value,expected", [
    ("--max_sequence_length", "-5", r"--max_sequence_length -5: must be an integer >= 1"),
    ("--max_sequence_length", "0", r"--max_sequence_length 0: must be an integer >= 1"),
    ("--seed", "99999999999999999", r"--seed 99999999999999999: must be an integer in \[0, 4294967295\]"),
    ("--seed", "-1", r"--seed -1: must be an integer in \[0, 4294967295\]"),
])
def test_out_of_range_flags_are_one_line_before_the_model(capsys, no_model, flag, value, expected):
    assert cli.main(["grpo", "--dataset_name", "shapes", "--reward_funcs", "shapes_partial", flag, value]) == 2
    assert re.search(expected, _one_error_line(capsys))
    with pytest.raises(ValueError, match=flag[2:]):
        FlowGRPOConfig(**{flag[2:]: int(value)})


def test_the_seed_range_edges_are_accepted():
    assert FlowGRPOConfig(seed=0).seed == 0 and FlowGRPOConfig(seed=2**32 - 1).seed == 2**32 - 1
    with pytest.raises(ValueError, match="seed"):
        FlowGRPOConfig(seed=2**32)
