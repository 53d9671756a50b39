"""The trainer registry: the guide's method (docs/adding_a_method.md) registered from outside the package trains
through the CLI and the Python API; every registered config classifies every field's resume behaviour."""

from __future__ import annotations

import dataclasses
import os
import re

import pytest

import trl_flow
from trl_flow.config_fields import RESUME_KINDS
from trl_flow.engine.checkpoints import resume_kinds
from trl_flow.trainers import registry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUIDE = os.path.join(ROOT, "docs", "adding_a_method.md")


@pytest.fixture
def clean_registry(monkeypatch):
    monkeypatch.setattr(registry, "_TRAINERS", {**registry._TRAINERS})
    monkeypatch.setattr(registry, "_ALIASES", {**registry._ALIASES})


@pytest.mark.parametrize("name", sorted(trl_flow.registered_trainers()))
def test_every_field_of_every_registered_config_is_classified(name):
    config_cls = trl_flow.registered_trainers()[name].config_class
    kinds = resume_kinds(config_cls)
    assert set(kinds) == {f.name for f in dataclasses.fields(config_cls)}
    assert set(kinds.values()) <= set(RESUME_KINDS)


def test_the_classification_is_what_resume_does():
    """A few fields whose kind decides real behaviour (a changed LoRA shape must be refused; a new output_dir not)."""
    kinds = resume_kinds(trl_flow.OPGRPOConfig)
    assert {k: kinds[k] for k in ("lora_r", "num_generations", "truncation_step", "sampler")} == dict.fromkeys(
        ("lora_r", "num_generations", "truncation_step", "sampler"), "refuse")
    assert kinds["learning_rate"] == kinds["weight_decay"] == "optimizer"
    assert kinds["output_dir"] == kinds["report_to"] == "harmless"
    assert kinds["beta"] == kinds["batch_layout"] == "notice"


def test_a_config_field_without_resume_kind_is_refused_at_registration(clean_registry):
    @dataclasses.dataclass
    class LooseConfig(trl_flow.FlowGRPOConfig):
        knob: int = dataclasses.field(default=1, metadata={"help": "a knob"})

    class LooseTrainer(trl_flow.FlowGRPOTrainer):
        config_class = LooseConfig

    with pytest.raises(TypeError, match=r"LooseConfig.knob: metadata\['resume'\] must be one of"):
        trl_flow.register_trainer("loose", LooseTrainer)


def _guide_blocks() -> list[str]:
    text = open(GUIDE, encoding="utf-8").read()
    return [m.group(2) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M) if m.group(1) == "python"]


def test_guide_code_runs(tmp_path, monkeypatch, clean_registry, capsys):
    """Every python block of docs/adding_a_method.md, in order, in one namespace: a Flow-GRPO subclass with one
    changed hook, registered from outside the package, is a `trl-flow` subcommand listed in --help, and trains one
    iteration on the shapes task through trl_flow.cli.main and through the Python API."""
    blocks = _guide_blocks()
    assert len(blocks) >= 4
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "adding_a_method_guide"}
    for i, code in enumerate(blocks):
        exec(compile(code, f"{GUIDE}:python-block-{i + 1}", "exec", dont_inherit=True), namespace)
    cls = trl_flow.registered_trainers()["rank-grpo"]
    assert cls.__module__ == "adding_a_method_guide" and issubclass(cls, trl_flow.FlowGRPOTrainer)
    for out in ("rank_grpo", "rank_grpo_py"):
        assert (tmp_path / "out" / out / "pytorch_lora_weights.safetensors").is_file(), out
    assert namespace["trainer"].state.global_step == 1
    from trl_flow.cli import main

    capsys.readouterr()
    assert main(["--help"]) == 0
    assert re.search(r"rank-grpo\s+Flow-GRPO with centred-rank advantages", capsys.readouterr().out)


def test_rank_advantages_of_the_guide(clean_registry):
    """The guide's hook computes what it says: centred ranks in [-1, 1] per group, 0 for a missing reward."""
    import torch

    namespace = {"__name__": "adding_a_method_guide"}
    for code in _guide_blocks()[:2]:
        exec(compile(code, GUIDE, "exec", dont_inherit=True), namespace)
    trainer = namespace["RankGRPOTrainer"].__new__(namespace["RankGRPOTrainer"])
    trainer.config = namespace["RankGRPOConfig"](rank_scale=2.0)
    trainer.gather = lambda t: t
    trainer._local_slice = lambda n: slice(0, n)
    trainer.accelerator = type("A", (), {"device": torch.device("cpu")})()
    rollout = type("R", (), {})()
    rollout.rewards = torch.tensor([0.1, 0.9, 0.5, float("nan"), 3.0, -1.0])
    rollout.group_ids = torch.tensor([0, 0, 0, 1, 1, 1])
    trainer.compute_advantages(rollout)
    assert rollout.advantages.tolist() == [-2.0, 2.0, 0.0, 0.0, 2.0, -2.0]


def test_trainer_entry_points_register_and_a_redundant_one_is_quiet(monkeypatch, clean_registry, tmp_path):
    """The entry-point group trl_flow.trainers, through the loader the adapters use: a plug-in trainer registers on
    first lookup; one naming the class a name already has is quietly redundant; a taken name or a broken plug-in
    warns, and the built-in trainers stay."""
    import warnings
    from importlib.metadata import EntryPoint

    (tmp_path / "toy_trl_flow_trainer.py").write_text(
        "import trl_flow\n\nclass ToyTrainer(trl_flow.FlowGRPOTrainer):\n    summary = 'a toy'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    eps = [EntryPoint(name=n, value=v, group=registry.ENTRY_POINT_GROUP) for n, v in (
        ("toy", "toy_trl_flow_trainer:ToyTrainer"),
        ("grpo", "trl_flow.trainers.flow_grpo_trainer:FlowGRPOTrainer"),  # the same class: no warning
        ("dppo", "toy_trl_flow_trainer:ToyTrainer"),  # a taken name: ignored, with a warning
        ("broken", "no_such_trl_flow_module_xyz:Trainer"),
    )]
    monkeypatch.setattr("importlib.metadata.entry_points",
                        lambda group=None, **kw: [ep for ep in eps if ep.group == group])
    monkeypatch.setattr(registry, "_entry_points_loaded", False)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainers = trl_flow.registered_trainers()
    messages = [str(w.message) for w in record]
    assert trainers["toy"].__name__ == "ToyTrainer" and trainers["grpo"] is trl_flow.FlowGRPOTrainer
    assert trainers["dppo"] is trl_flow.FlowDPPOTrainer
    assert any("dppo already has a trainer (FlowDPPOTrainer)" in m for m in messages), messages
    assert any("broken" in m and "ModuleNotFoundError" in m for m in messages), messages
    assert not any("entry point grpo" in m for m in messages), messages
