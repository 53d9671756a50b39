"""The trl-flow command line: parsing (YAML recipes, overrides, no abbreviations), lazy trainer lookup,
reward resolution, dataset splits, and the hand-off to accelerate launch."""

from __future__ import annotations

import os
import sys
import types

import pytest

from trl_flow import cli


def test_full_option_names_only(capsys):
    with pytest.raises(cli.CLIError, match="unrecognized arguments: --num_gen 3"):
        cli.parse_args("grpo", ["--num_gen", "3"])
    assert cli.main(["grpo", "--num_gen", "3"]) == 2
    assert "--num_gen" in capsys.readouterr().err
    _, config, rest = cli.parse_args("grpo", ["--num_generations", "3"])
    assert config.num_generations == 3 and rest == []


def test_yaml_recipe_sets_fields_and_the_command_line_overrides_it(tmp_path):
    from trl_flow import FlowGRPOConfig

    recipe = tmp_path / "r.yaml"
    recipe.write_text("trainer: grpo\ndataset_name: prompts.txt\nreward_funcs: [jpeg_incompressibility]\n"
                      "learning_rate: 1e-4\nnum_generations: 6\nlora_target_modules: [attn.to_q, attn.to_v]\n"
                      "bf16: true\nreport_to: none\n")
    script, config, _ = cli.parse_args("grpo", ["--config", str(recipe), "--num_generations", "12"])
    assert isinstance(config, FlowGRPOConfig)
    assert config.learning_rate == 1e-4 and config.num_generations == 12 and config.bf16 is True
    assert config.lora_target_modules == ["attn.to_q", "attn.to_v"] and config.report_to == []
    assert script.dataset_name == "prompts.txt" and script.reward_funcs == ["jpeg_incompressibility"]
    assert script.dataset_train_split == "train" and script.dataset_test_split == "test"
    assert script.model_name_or_path == "stabilityai/stable-diffusion-3.5-medium"

    recipe.write_text("num_generations: 4\nnum_generation: 5\n")
    with pytest.raises(cli.CLIError, match=r"--config: unknown keys \['num_generation'\]"):
        cli.parse_args("grpo", ["--config", str(recipe)])
    recipe.write_text("trainer: op-grpo\n")
    with pytest.raises(cli.CLIError, match="this recipe is for `trl-flow op-grpo`"):
        cli.parse_args("grpo", ["--config", str(recipe)])
    with pytest.raises(cli.CLIError, match="not a file and not a name shipped in trl_flow/recipes"):
        cli.parse_args("grpo", ["--config", "no_such_recipe"])
    with pytest.raises(cli.CLIError, match=r"FlowGRPOConfig.clip_range=2.0: must be in \(0, 1\)|clip_range"):
        cli.parse_args("grpo", ["--clip_range", "2"])


def test_a_registered_trainer_is_a_subcommand(monkeypatch, capsys):
    import trl_flow
    from trl_flow.trainers import registry

    with pytest.raises(cli.CLIError, match="unknown command 'future'"):
        cli.parse_args("future", [])
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["future", "--max_steps", "1"])
    assert exit_info.value.code == 2
    # The moment a trainer is registered under the name, the subcommand works and --help lists it.
    monkeypatch.setattr(registry, "_TRAINERS", {**registry._TRAINERS})
    monkeypatch.setattr(registry, "_ALIASES", {**registry._ALIASES})

    class FutureTrainer(trl_flow.FlowGRPOTrainer):
        summary = "a later method"

    trl_flow.register_trainer("future", FutureTrainer, aliases=("future_method",))
    _, config, _ = cli.parse_args("future", ["--max_steps", "3"])
    assert isinstance(config, trl_flow.FlowGRPOConfig) and config.max_steps == 3
    assert cli.trainer_classes("future_method")[1] is FutureTrainer
    assert cli.main(["--help"]) == 0
    assert "a later method (also: future_method)" in capsys.readouterr().out


def test_registry_refuses_clashes_and_bad_names():
    import trl_flow

    class Other(trl_flow.FlowGRPOTrainer):
        pass

    with pytest.raises(ValueError, match="'grpo' already names FlowGRPOTrainer"):
        trl_flow.register_trainer("grpo", Other)
    with pytest.raises(ValueError, match="not a command-line name"):
        trl_flow.register_trainer("My Method", Other)
    with pytest.raises(TypeError, match="not a FlowRLTrainer subclass"):
        trl_flow.register_trainer("thing", object)
    assert trl_flow.registered_trainers()["grpo"] is trl_flow.FlowGRPOTrainer
    assert "Other" not in {c.__name__ for c in trl_flow.registered_trainers().values()}


def test_reward_server_is_dispatched_lazily(monkeypatch, capsys):
    seen = []
    server = types.SimpleNamespace(main=lambda argv: seen.append(argv) or 0)
    monkeypatch.setitem(sys.modules, "trl_flow.rewards.server", server)
    real_import = cli.importlib.import_module
    monkeypatch.setattr(cli.importlib, "import_module",
                        lambda name: server if name == "trl_flow.rewards.server" else real_import(name))
    assert cli.main(["reward-server", "--port", "8123"]) == 0 and seen == [["--port", "8123"]]

    def missing(name):
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    monkeypatch.setattr(cli.importlib, "import_module", missing)
    assert cli.main(["reward-server"]) == 2
    assert "reward-server: error: not available in this version" in capsys.readouterr().err


def test_rewards_resolve_from_names_modules_and_classes(tmp_path, monkeypatch):
    from trl_flow.rewards import jpeg_incompressibility
    from trl_flow.tasks.shapes import shapes_partial_reward

    (tmp_path / "my_rewards.py").write_text(
        "def score(images, prompts, **kw):\n    return [1.0] * len(prompts)\n\n"
        "class Scorer:\n    def __call__(self, images, prompts, **kw):\n        return [2.0] * len(prompts)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cli.resolve_reward("jpeg_incompressibility") is jpeg_incompressibility
    assert cli.resolve_reward("shapes_partial") is shapes_partial_reward
    assert cli.resolve_reward("my_rewards:score")(None, ["a"]) == [1.0]
    assert cli.resolve_reward("my_rewards:Scorer")(None, ["a", "b"]) == [2.0, 2.0]  # a class is instantiated
    with pytest.raises(cli.CLIError, match="unknown name; use one of .*jpeg_compressibility"):
        cli.resolve_reward("jpeg")
    with pytest.raises(cli.CLIError, match="module 'my_rewards' has no attribute 'nope'"):
        cli.resolve_reward("my_rewards:nope")


def test_eval_dataset_loads_the_test_split(tmp_path, monkeypatch):
    import datasets
    from datasets import Dataset, DatasetDict

    calls, real_load_dataset = [], datasets.load_dataset

    def fake_load_dataset(path, name=None, split=None, **kw):  # the Hub; local builders run for real
        if path in ("text", "json"):
            return real_load_dataset(path, name, split=split, **kw)
        calls.append((path, name, split))
        return Dataset.from_dict({"prompt": [f"{path}:{split}"]})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    script, config, _ = cli.parse_args("grpo", ["--dataset_name", "org/prompts", "--dataset_config", "geneval",
                                                 "--eval_dataset", "org/eval-prompts"])
    train, evald = cli._load_datasets(script, config)
    assert calls == [("org/prompts", "geneval", "train"), ("org/eval-prompts", None, "test")]
    assert train["prompt"] == ["org/prompts:train"] and evald["prompt"] == ["org/eval-prompts:test"]
    # With eval_steps and no eval_dataset, the test split of dataset_name; a custom split name is honoured.
    calls.clear()
    script, config, _ = cli.parse_args("grpo", ["--dataset_name", "org/prompts", "--eval_steps", "5",
                                                 "--dataset_test_split", "validation"])
    cli._load_datasets(script, config)
    assert calls == [("org/prompts", None, "train"), ("org/prompts", None, "validation")]

    # A DatasetDict saved on disk: each split from its own rows.
    folder = tmp_path / "dd"
    DatasetDict({"train": Dataset.from_dict({"prompt": ["a", "b"]}),
                 "test": Dataset.from_dict({"prompt": ["held out"]})}).save_to_disk(str(folder))
    script, config, _ = cli.parse_args("grpo", ["--dataset_name", str(folder), "--eval_dataset", str(folder)])
    train, evald = cli._load_datasets(script, config)
    assert train["prompt"] == ["a", "b"] and evald["prompt"] == ["held out"]
    txt = tmp_path / "p.txt"
    txt.write_text("a cat\n")
    script, config, _ = cli.parse_args("grpo", ["--dataset_name", str(txt), "--eval_steps", "5"])
    with pytest.raises(cli.CLIError, match="has no test split; pass --eval_dataset"):
        cli._load_datasets(script, config)


def test_missing_inputs_fail_before_loading_the_model(monkeypatch):
    monkeypatch.setattr(cli, "_load_pipeline", lambda *a: pytest.fail("the model was loaded"))
    with pytest.raises(cli.CLIError, match="reward_funcs: required"):
        cli.run("grpo", ["--dataset_name", "shapes"])
    with pytest.raises(cli.CLIError, match="dataset_name: required"):
        cli.run("grpo", ["--reward_funcs", "jpeg_incompressibility"])
    with pytest.raises(cli.CLIError, match="unknown name"):
        cli.run("grpo", ["--dataset_name", "shapes", "--reward_funcs", "nope"])


def test_accelerate_config_relaunches_through_accelerate_launch(monkeypatch):
    import accelerate.commands.launch as launch

    captured = {}

    def fake_launch(args):
        captured["args"] = args
        captured["child_env"] = os.environ.get(cli._CHILD_ENV)

    monkeypatch.setattr(launch, "launch_command", fake_launch)
    argv = ["--accelerate_config", "multi_node", "--max_steps", "2", "--machine_rank", "1",
            "--main_process_ip", "10.0.0.1", "--num_processes", "2", "--config", "shapes_flow_grpo"]
    assert cli.run("grpo", argv) is None
    args = captured["args"]
    assert args.config_file == cli.shipped("accelerate_configs")["multi_node"]
    assert args.machine_rank == 1 and args.main_process_ip == "10.0.0.1" and args.num_processes == 2
    assert args.module and args.training_script == "trl_flow.cli"
    # The started processes get the command without the launch options (the "2" of max_steps stays).
    assert args.training_script_args == ["grpo", "--max_steps", "2", "--config", "shapes_flow_grpo"]
    assert captured["child_env"] == "1" and cli._CHILD_ENV not in os.environ

    with pytest.raises(cli.CLIError, match="unrecognized arguments: --num_proc"):
        cli.run("grpo", ["--accelerate_config", "multi_gpu", "--num_proc", "2"])
    with pytest.raises(cli.CLIError, match="not a name shipped in trl_flow/accelerate_configs"):
        cli.run("grpo", ["--accelerate_config", "tpu_pod", "--dataset_name", "shapes"])
    with pytest.raises(cli.CLIError, match="`accelerate launch` options need --accelerate_config"):
        cli.run("grpo", ["--num_processes", "2"])


def test_top_level_help_lists_the_commands(capsys):
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    for name in ("grpo", "op-grpo", "stepwise", "dppo", "reward-server"):
        assert name in out
    with pytest.raises(SystemExit):
        cli.main(["gpro"])


def test_registered_reward_names_resolve_to_built_rewards():
    """`--reward_funcs pickscore` (what the SD3.5 recipes use) gives the built reward model, not its factory."""
    from trl_flow.cli import resolve_reward
    from trl_flow.rewards import RewardModel
    from trl_flow.tasks import shapes

    assert isinstance(resolve_reward("pickscore"), RewardModel)
    assert resolve_reward("shapes_dense") is shapes.shapes_dense_reward
    assert resolve_reward("trl_flow.tasks.shapes:shapes_strict_reward") is shapes.shapes_strict_reward


# ------------------------------------------------------------------ errors a user can act on
def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and "usage:" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("trl-flow ")]  # (progress bars aside)
    assert len(lines) == 1, err  # the error is one line
    return lines[0]


def test_misspelled_option_gets_a_did_you_mean(capsys):
    assert cli.main(["grpo", "--max_step", "3"]) == 2
    line = _one_error_line(capsys)
    assert "unrecognized arguments: --max_step 3" in line and "did you mean --max_steps?" in line
    assert cli.main(["grpo", "--num_gen", "3"]) == 2
    assert "did you mean --num_generations?" in _one_error_line(capsys)
    assert cli.main(["grpo", "--zzzz", "3"]) == 2
    assert "did you mean" not in _one_error_line(capsys)


def test_a_recipe_key_misspelled_gets_a_did_you_mean(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("learning_rat: 1e-4\n")
    with pytest.raises(cli.CLIError, match=r"did you mean: learning_rat -> learning_rate\?"):
        cli.parse_args("grpo", ["--config", str(recipe)])
    with pytest.raises(cli.CLIError, match=r"did you mean --config shapes_flow_grpo\?"):
        cli.parse_args("grpo", ["--config", "shapes_flowgrpo"])
    with pytest.raises(cli.CLIError, match=r"did you mean --accelerate_config multi_gpu\?"):
        cli._resolve_yaml("multigpu", "accelerate_configs", "--accelerate_config")


def test_bad_values_are_one_line_errors_naming_the_flag(capsys):
    assert cli.main(["grpo", "--max_steps", "abc"]) == 2
    line = _one_error_line(capsys)
    assert "--max_steps" in line and "'abc'" in line and "usage:" not in line
    # a field's own check speaks in flags: `--clip_range 2.0`, not `FlowGRPOConfig.clip_range=2.0`
    assert cli.main(["grpo", "--clip_range", "2"]) == 2
    line = _one_error_line(capsys)
    assert "--clip_range 2" in line and "clip_range=" not in line


def test_help_shows_config_and_the_recipes_of_the_command(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["op-grpo", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "--config RECIPE_OR_YAML" in out
    assert "shapes_op_grpo" in out and "sd35m_op_grpo_geneval" in out
    assert "shapes_flow_grpo" not in out  # a recipe for another command is not offered


def test_python_api_fixes_are_rewritten_to_flags():
    names = ["output_dir", "resume_from_checkpoint", "overwrite_output_dir", "clip_range"]
    msg = ("output_dir='d' already holds an earlier run's outputs (log_history.jsonl); pass\n"
           "resume_from_checkpoint=True to continue, overwrite_output_dir=True to delete them; "
           "FlowGRPOConfig.clip_range=2.0: must be in (0, 1); same as train(resume_from_checkpoint=...)")
    assert cli.cli_form(msg, names) == (
        "--output_dir 'd' already holds an earlier run's outputs (log_history.jsonl); pass "
        "--resume_from_checkpoint True to continue, --overwrite_output_dir True to delete them; "
        "--clip_range 2.0: must be in (0, 1); same as train(resume_from_checkpoint=...)")


def test_resume_true_on_the_command_line_means_what_it_does_in_python():
    from trl_flow.engine.checkpoints import normalize_resume

    for spelling in ("True", "true", "latest"):
        _, config, _ = cli.parse_args("grpo", ["--resume_from_checkpoint", spelling])
        assert normalize_resume(config.resume_from_checkpoint) is True


def test_an_earlier_run_in_output_dir_is_refused_in_flags_on_one_line(tmp_path, monkeypatch, capsys, fresh_pipe):
    out = tmp_path / "run"
    out.mkdir()
    (out / "log_history.jsonl").write_text('{"step": 1}\n')
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\na dog\n")
    monkeypatch.setattr(cli, "_load_pipeline", lambda *a: fresh_pipe())
    rc = cli.main(["grpo", "--output_dir", str(out), "--dataset_name", str(prompts), "--reward_funcs",
                   "jpeg_incompressibility", "--height", "32", "--width", "32", "--max_sequence_length", "16",
                   "--num_inference_steps", "2", "--num_generations", "2", "--prompts_per_step", "2",
                   "--per_device_train_batch_size", "4", "--max_steps", "1"])
    assert rc == 2
    line = _one_error_line(capsys)
    assert "already holds an earlier run's outputs" in line
    assert "--overwrite_output_dir True" in line and "overwrite_output_dir=True" not in line
    assert (out / "log_history.jsonl").read_text() == '{"step": 1}\n'


def test_runtime_failures_are_one_line_and_keep_the_traceback_on_request(monkeypatch, capsys):
    def boom(command, argv):
        raise RuntimeError("reward function 'r' raised\nConnectionError: refused")

    monkeypatch.setattr(cli, "run", boom)
    assert cli.main(["grpo"]) == 1
    line = _one_error_line(capsys)
    assert "reward function 'r' raised ConnectionError: refused" in line and "TRL_FLOW_TRACEBACK=1" in line
    monkeypatch.setenv("TRL_FLOW_TRACEBACK", "1")
    with pytest.raises(RuntimeError):
        cli.main(["grpo"])


# ----------------------------------------------------------------------------------- threads
def test_num_threads_default_is_one_unless_omp_num_threads_or_the_flag_says_otherwise(capsys):
    assert cli.resolve_num_threads(None, {}) == 1
    assert cli.resolve_num_threads(None, {"OMP_NUM_THREADS": "4"}) == 4
    assert cli.resolve_num_threads(None, {"OMP_NUM_THREADS": "junk"}) == 1
    assert cli.resolve_num_threads(3, {"OMP_NUM_THREADS": "4"}) == 3
    assert cli.resolve_num_threads(0, {}) is None  # torch's own default
    assert cli.main(["grpo", "--num_threads", "-1"]) == 2
    assert "--num_threads -1: must be >= 0" in _one_error_line(capsys)


def test_the_run_sets_the_thread_count_before_any_work(monkeypatch):
    import torch

    seen = []
    monkeypatch.setattr(torch, "set_num_threads", seen.append)
    monkeypatch.setattr(cli, "_load_pipeline", lambda *a: pytest.fail("the model was loaded"))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for argv, expected in ((["--num_threads", "3"], [3]), ([], [1]), (["--num_threads", "0"], [])):
        seen.clear()
        with pytest.raises(cli.CLIError, match="reward_funcs: required"):
            cli.run("grpo", ["--dataset_name", "shapes", *argv])
        assert seen == expected


def test_a_recipe_of_another_trainer_says_how_to_run_it(capsys):
    """`trl-flow nft --config shapes_op_grpo`: refused before its OP-GRPO keys are checked against DiffusionNFT's
    fields, naming the recipe's `trainer:` key, the command that runs it and nft's own recipes."""
    assert cli.main(["nft", "--config", "shapes_op_grpo"]) == 2
    err = capsys.readouterr().err
    assert "`trainer: op-grpo`" in err and "trl-flow op-grpo --config shapes_op_grpo" in err
    assert "set `trainer: nft`" in err and "shapes_nft" in err and "unknown keys" not in err


def test_help_is_grouped_and_short(capsys, monkeypatch):
    """`--help` groups the fields by section and shows each help text's first sentence (the full text is in the
    docs' configuration tables): about half the lines it had (513 at 80 columns before)."""
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit):
        cli.main(["grpo", "--help"])
    out = capsys.readouterr().out
    for section in ("model, data, rewards, launch:", "batch:", "optimisation:", "sampling:", "objective:"):
        assert f"\n{section}\n" in out, section
    assert len(out.splitlines()) < 300
    assert "unverified" not in out  # kl_mask_delta's long story stays in the docs
    assert "--max_steps INT" in out and "--max-steps" not in out  # one spelling shown ...
    _, config, _ = cli.parse_args("grpo", ["--max-steps", "3"])  # ... both accepted
    assert config.max_steps == 3
