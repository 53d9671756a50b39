"""transformers' callbacks on every trainer (``callbacks=[...]``: the events, ``TrainerState`` / ``TrainerControl``,
the flags honoured, a stop that saves the final model and resumes exactly), and a model id or folder in place of a
pipeline (``model_init_kwargs``; a bad one fails before any compute, naming it)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import PROMPTS, brightness, tiny_config
from transformers import TrainerCallback, TrainerControl, TrainerState
from transformers.trainer_callback import DefaultFlowCallback, ExportableState

import trl_flow
from trl_flow import FlowGRPOConfig, FlowGRPOTrainer
from trl_flow.engine import checkpoints

EVENTS = ("on_init_end", "on_train_begin", "on_step_begin", "on_step_end", "on_log", "on_save", "on_evaluate",
          "on_train_end", "on_push_begin")


class Recorder(TrainerCallback):
    """Records (event, global_step, logs / metrics) and checks the classes every event gets."""

    def __init__(self):
        self.calls = []

    def _record(self, event, args, state, control, **kwargs):
        assert isinstance(state, TrainerState) and isinstance(control, TrainerControl)
        assert isinstance(args, trl_flow.FlowRLConfig) and kwargs["model"] is not None
        self.calls.append((event, state.global_step, kwargs.get("logs", kwargs.get("metrics"))))

    def events(self) -> list[tuple[str, int]]:
        return [(e, n) for e, n, _ in self.calls]


for _event in EVENTS:
    setattr(Recorder, _event, lambda self, args, state, control, _e=_event, **kw: self._record(_e, args, state,
                                                                                                  control, **kw))


class StopAt(Recorder):
    """Stops training in ``on_step_end`` once ``state.global_step == step``."""

    def __init__(self, step):
        super().__init__()
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        self._record("on_step_end", args, state, control, **kwargs)
        if state.global_step == self.step:
            control.should_training_stop = True


def _lora(trainer) -> dict:
    return {n: p.detach().clone() for n, p in trainer.pipe.transformer.named_parameters() if "lora_" in n}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _saved_lora(folder) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(folder, "pytorch_lora_weights.safetensors"))


# ------------------------------------------------------------------------------------------ the shapes run
def _shapes_trainer(output_dir, callbacks=None, **overrides):
    from trl_flow.tasks import shapes

    kwargs = dict(output_dir=str(output_dir), height=32, width=32, max_steps=4, num_inference_steps=4,
                  prompts_per_step=2, num_generations=4, per_device_train_batch_size=4, save_steps=1,
                  max_sequence_length=shapes.MAX_SEQUENCE_LENGTH, guidance_scale=shapes.DEFAULT_GUIDANCE_SCALE,
                  disable_tqdm=True)
    kwargs.update(overrides)
    prompts = list(shapes.train_prompts()["prompt"][:16])
    return FlowGRPOTrainer(FlowGRPOConfig(**kwargs), shapes.load_base_pipeline(), [shapes.shapes_partial_reward],
                           train_dataset=prompts, callbacks=callbacks)


def test_a_callback_stops_a_shapes_run_which_saves_and_resumes_exactly(tmp_path):
    stop = StopAt(2)
    trainer = _shapes_trainer(tmp_path / "stopped", callbacks=[stop])
    state = trainer.train()
    assert state is trainer.state and isinstance(state, TrainerState) and isinstance(state, checkpoints.TrainerState)
    assert state.global_step == 2 and state.max_steps == 4
    assert ("on_step_end", 2) in stop.events() and ("on_step_begin", 2) not in stop.events()
    assert stop.events() == [("on_init_end", 0), ("on_train_begin", 0),
                             ("on_step_begin", 0), ("on_step_end", 1), ("on_log", 1), ("on_save", 1),
                             ("on_step_begin", 1), ("on_step_end", 2), ("on_log", 2), ("on_save", 2),
                             ("on_train_end", 2)]
    logs = [calls for event, _, calls in stop.calls if event == "on_log"]
    assert [entry["step"] for entry in state.log_history] == [1, 2]
    assert logs == [{k: v for k, v in e.items() if k != "step"} for e in state.log_history]
    assert all("reward" in entry for entry in logs)
    stopped_dir = tmp_path / "stopped"
    checkpoint_names = sorted(n for n in os.listdir(stopped_dir) if n.startswith("checkpoint-"))
    assert checkpoint_names == ["checkpoint-1", "checkpoint-2"]
    final = _saved_lora(stopped_dir)  # the final model, as at the end of an uninterrupted run
    assert _same(final, _saved_lora(stopped_dir / "checkpoint-2"))
    assert len(final) == len(_lora(trainer))

    resumed = _shapes_trainer(tmp_path / "stopped")
    resumed.train(resume_from_checkpoint=str(stopped_dir / "checkpoint-2"))
    straight = _shapes_trainer(tmp_path / "straight")
    straight.train()
    assert resumed.state.global_step == straight.state.global_step == 4
    assert _same(_lora(resumed), _lora(straight))  # bit for bit
    assert not _same(_lora(resumed), _lora(trainer))
    assert _same(_saved_lora(stopped_dir), _saved_lora(tmp_path / "straight"))
    assert [e["step"] for e in resumed.state.log_history] == [1, 2, 3, 4]
    assert [e["reward"] for e in resumed.state.log_history] == [e["reward"] for e in straight.state.log_history]


# ------------------------------------------------------------------------------- tiny pipeline: the flags
def _trainer(tmp_path, fresh_pipe, callbacks, eval_dataset=None, **overrides):
    overrides.setdefault("output_dir", str(tmp_path / "out"))
    return FlowGRPOTrainer(tiny_config(tmp_path, **overrides), fresh_pipe(), [brightness],
                           train_dataset=list(PROMPTS), eval_dataset=eval_dataset, callbacks=callbacks)


def test_without_callbacks_the_run_is_the_configured_schedule(tmp_path, fresh_pipe):
    trainer = _trainer(tmp_path, fresh_pipe, None, max_steps=3, logging_steps=2, save_steps=2)
    assert type(trainer.callback_handler.callbacks[0]).__mro__[1] is DefaultFlowCallback
    assert len(trainer.callback_handler.callbacks) == 1
    trainer.train()
    out = tmp_path / "out"
    assert [e["step"] for e in trainer.state.log_history] == [2, 3]  # every logging_steps, and the last
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == ["checkpoint-2"]
    assert os.path.isfile(out / "pytorch_lora_weights.safetensors")
    assert trainer.state.logging_steps == 2 and trainer.state.save_steps == 2 and trainer.state.max_steps == 3


class Flags(Recorder):
    """Sets the given control flags in ``on_step_end`` at the given steps: ``{step: [flag, ...]}``."""

    def __init__(self, plan):
        super().__init__()
        self.plan = plan

    def on_step_end(self, args, state, control, **kwargs):
        self._record("on_step_end", args, state, control, **kwargs)
        for flag in self.plan.get(state.global_step, ()):
            setattr(control, flag, True)


def test_should_save_should_log_should_evaluate_are_honoured(tmp_path, fresh_pipe):
    rec = Flags({1: ["should_save", "should_log", "should_evaluate"]})
    trainer = _trainer(tmp_path, fresh_pipe, [rec], eval_dataset=list(PROMPTS[:2]), max_steps=3, logging_steps=10,
                       eval_steps=10)
    trainer.train()
    out = tmp_path / "out"
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == ["checkpoint-1"]
    steps = [(e["step"], "eval/reward" in e) for e in trainer.state.log_history]
    # eval_steps=10 > max_steps: evaluated before the first iteration and after the last; step 1 by the callback
    assert steps == [(0, True), (1, False), (1, True), (3, False), (3, True)]
    evaluated = [(n, sorted(m)) for e, n, m in rec.calls if e == "on_evaluate"]
    assert evaluated == [(n, ["eval/brightness", "eval/reward"]) for n in (0, 1, 3)]
    assert ("on_save", 1) in rec.events() and [e for e, _ in rec.events()].count("on_save") == 1
    events = rec.events()
    assert events.index(("on_save", 1)) < events.index(("on_evaluate", 1)) < events.index(("on_step_begin", 1))


class StopOnEvalAndSave(Recorder):
    """Asks for a checkpoint and the stop from ``on_evaluate``, after the loop's own save decisions of the step."""

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self._record("on_evaluate", args, state, control, metrics=metrics, **kwargs)
        if state.global_step == 1:
            control.should_save = True
            control.should_training_stop = True


def test_flags_set_in_on_evaluate_save_and_stop_in_the_same_step(tmp_path, fresh_pipe):
    rec = StopOnEvalAndSave()
    trainer = _trainer(tmp_path, fresh_pipe, [rec], eval_dataset=list(PROMPTS[:2]), max_steps=3, eval_steps=1)
    trainer.train()
    out = tmp_path / "out"
    assert trainer.state.global_step == 1
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == ["checkpoint-1"]
    assert _same(_saved_lora(out), _saved_lora(out / "checkpoint-1"))  # the final model is saved too
    assert rec.events()[-1] == ("on_train_end", 1)


def test_a_callback_cannot_run_past_max_steps(tmp_path, fresh_pipe):
    class Continue(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = False
            control.should_log = False

    trainer = _trainer(tmp_path, fresh_pipe, [Continue()], max_steps=2)
    trainer.train()
    assert trainer.state.global_step == 2 and [e["step"] for e in trainer.state.log_history] == [2]
    assert os.path.isfile(tmp_path / "out" / "pytorch_lora_weights.safetensors")


@pytest.mark.parametrize("event", ["on_step_end", "on_log", "on_save"])
def test_a_stop_set_in_any_event_of_the_iteration_ends_it(event, tmp_path, fresh_pipe):
    def stop(self, args, state, control, **kwargs):
        if state.global_step == 2:
            control.should_training_stop = True
        return TrainerControl(**control.state()["args"])  # a new object, as a callback may return

    trainer = _trainer(tmp_path, fresh_pipe, [type("Stop", (TrainerCallback,), {event: stop})()], max_steps=4,
                       save_steps=1)
    trainer.train()
    out = tmp_path / "out"
    assert trainer.state.global_step == 2 and [e["step"] for e in trainer.state.log_history] == [1, 2]
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == ["checkpoint-1", "checkpoint-2"]
    assert _same(_saved_lora(out), _saved_lora(out / "checkpoint-2"))


def test_on_push_begin_fires_after_on_train_end_before_the_push(tmp_path, fresh_pipe, monkeypatch):
    import trl_flow.hub

    monkeypatch.setattr(trl_flow.hub, "check_hub_access", lambda *a, **k: None)
    rec = Recorder()
    trainer = _trainer(tmp_path, fresh_pipe, [rec], max_steps=1, push_to_hub=True, hub_model_id="me/tiny")
    monkeypatch.setattr(trainer, "push_to_hub", lambda *a, **k: rec.calls.append(("push", None, None)))
    trainer.train()
    assert rec.events()[-3:] == [("on_train_end", 1), ("on_push_begin", 1), ("push", None)]


class Counter(TrainerCallback, ExportableState):
    """A stateful callback: its count is saved with each checkpoint and restored on resume."""

    def __init__(self):
        self.count = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.count += 1

    def state(self) -> dict:
        return {"args": {}, "attributes": {"count": self.count}}


def test_exportable_callbacks_are_saved_with_checkpoints_and_restored(tmp_path, fresh_pipe):
    first = Counter()
    _trainer(tmp_path, fresh_pipe, [first], max_steps=2, save_steps=1).train()
    saved = json.load(open(tmp_path / "out" / "checkpoint-1" / checkpoints.STATE_NAME))
    assert saved["stateful_callbacks"] == {"Counter": {"args": {}, "attributes": {"count": 1}}}
    again = Counter()
    trainer = _trainer(tmp_path, fresh_pipe, [again], max_steps=3, save_steps=1)
    trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-1"))
    assert again.count == 3  # 1 restored + 2 iterations


def test_callbacks_must_be_trainer_callbacks(tmp_path, fresh_pipe):
    with pytest.raises(TypeError, match="callbacks: .*is not a transformers.TrainerCallback"):
        _trainer(tmp_path, fresh_pipe, [lambda *a: None])
    with pytest.raises(TypeError, match="callbacks: expected a list"):
        _trainer(tmp_path, fresh_pipe, Recorder())
    rec_cls = _trainer(tmp_path, fresh_pipe, [Recorder]).callback_handler.callbacks[1]  # a class is instantiated
    assert type(rec_cls) is Recorder


def _trainer_classes() -> list:
    return sorted({cls for cls in trl_flow.registered_trainers().values()}, key=lambda c: c.__name__)


@pytest.mark.parametrize("cls", _trainer_classes(), ids=lambda c: c.__name__)
def test_every_trainer_takes_callbacks(cls, tmp_path, fresh_pipe):
    rec = StopAt(1)
    trainer = cls(tiny_config(tmp_path, config_class=cls.config_class, max_steps=2), fresh_pipe(), [brightness],
                  train_dataset=list(PROMPTS), callbacks=[rec])
    trainer.train()
    assert trainer.state.global_step == 1
    assert [e for e, _ in rec.events()] == ["on_init_end", "on_train_begin", "on_step_begin", "on_step_end",
                                            "on_log", "on_train_end"]


# ------------------------------------------------------------------------------------ a model id or folder
def _counting_reward():
    calls = []

    def reward(images, prompts, **kwargs):
        calls.append(len(prompts))
        return images.mean(dim=(1, 2, 3))

    return reward, calls


def test_a_saved_pipeline_folder_trains(tmp_path):
    from trl_flow.testing import tiny_sd3_pipeline

    folder = tmp_path / "tiny"
    tiny_sd3_pipeline().save_pretrained(str(folder))
    reward, calls = _counting_reward()
    config = tiny_config(tmp_path, max_steps=1, model_init_kwargs={"dtype": "float32"})
    trainer = FlowGRPOTrainer(config, str(folder), [reward], train_dataset=list(PROMPTS))
    assert type(trainer.pipe).__name__ == "StableDiffusion3Pipeline"
    assert trainer.pipe.transformer.dtype == torch.float32
    trainer.train()
    assert trainer.state.global_step == 1 and calls
    assert os.path.isfile(tmp_path / "out" / "pytorch_lora_weights.safetensors")
    by_path = FlowGRPOTrainer(tiny_config(tmp_path, output_dir=str(tmp_path / "o2")), folder, [brightness],
                              train_dataset=list(PROMPTS))  # an os.PathLike too
    assert type(by_path.pipe).__name__ == "StableDiffusion3Pipeline"


@pytest.mark.parametrize("model, match", [
    ("no-such-org/no-such-model", "model 'no-such-org/no-such-model' is not in the local Hugging Face cache.*"
                                  "HF_HUB_OFFLINE"),
    ("not a model id!", "model 'not a model id!': no such folder, and not a Hugging Face Hub id"),
    ("./missing/folder", "model './missing/folder': no such folder"),
])
def test_a_bad_model_id_fails_before_any_compute_naming_it(model, match, tmp_path):
    reward, calls = _counting_reward()
    with pytest.raises(ValueError, match=match):
        FlowGRPOTrainer(tiny_config(tmp_path), model, [reward], train_dataset=list(PROMPTS))
    assert calls == []  # the rewards' check (the first compute) never ran
    assert not os.path.exists(tmp_path / "out")


def test_a_hub_id_in_the_local_cache_loads_offline(tmp_path):
    """HF_HUB_OFFLINE (set by conftest): a Hub id loads from the cache (``cache_dir`` of model_init_kwargs, laid
    out as huggingface_hub does); one missing there is named with the cache it was looked up in."""
    from trl_flow.testing import tiny_sd3_pipeline

    cache, commit = tmp_path / "hub", "0" * 40
    tiny_sd3_pipeline().save_pretrained(str(cache / "models--tiny-org--tiny-sd3" / "snapshots" / commit))
    (cache / "models--tiny-org--tiny-sd3" / "refs").mkdir()
    (cache / "models--tiny-org--tiny-sd3" / "refs" / "main").write_text(commit)
    config = tiny_config(tmp_path, model_init_kwargs={"cache_dir": str(cache)})
    trainer = FlowGRPOTrainer(config, "tiny-org/tiny-sd3", [brightness], train_dataset=list(PROMPTS))
    assert type(trainer.pipe).__name__ == "StableDiffusion3Pipeline"
    reward, calls = _counting_reward()
    missing = f"model 'tiny-org/other' is not in the local Hugging Face cache \\({cache}\\) and HF_HUB_OFFLINE"
    with pytest.raises(ValueError, match=missing):
        FlowGRPOTrainer(config, "tiny-org/other", [reward], train_dataset=list(PROMPTS))
    assert calls == []


def test_a_folder_without_a_pipeline_is_named(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=f"model '{empty}': the folder has no model_index.json"):
        FlowGRPOTrainer(tiny_config(tmp_path), str(empty), [brightness], train_dataset=list(PROMPTS))


def test_model_init_kwargs_checks(tmp_path, fresh_pipe):
    with pytest.raises(ValueError, match="model_init_kwargs.*not a JSON object"):
        tiny_config(tmp_path, model_init_kwargs="{dtype: bf16")
    assert tiny_config(tmp_path, model_init_kwargs='{"variant": "fp16"}').model_init_kwargs == {"variant": "fp16"}
    with pytest.raises(ValueError, match="dtype='float33' is not a torch dtype"):
        FlowGRPOTrainer(tiny_config(tmp_path, model_init_kwargs={"dtype": "float33"}), "org/model", [brightness],
                        train_dataset=list(PROMPTS))
    with pytest.warns(UserWarning, match="model_init_kwargs=.*got a StableDiffusion3Pipeline.*ignored"):
        FlowGRPOTrainer(tiny_config(tmp_path, model_init_kwargs={"dtype": "float32"}), fresh_pipe(), [brightness],
                        train_dataset=list(PROMPTS))


def test_model_init_kwargs_on_the_command_line_reach_the_trainer(tmp_path, monkeypatch):
    from trl_flow import cli

    argv = ["--model_name_or_path", "org/model", "--output_dir", str(tmp_path), "--bf16", "true"]
    script_args, config, _ = cli.parse_args("grpo", [*argv, "--model_init_kwargs", '{"revision": "v2"}'])
    assert cli._load_pipeline(script_args, config) == "org/model"  # loaded by the trainer, with them
    assert config.model_init_kwargs == {"revision": "v2", "dtype": "bfloat16"}
    script_args, config, _ = cli.parse_args("grpo", argv)
    monkeypatch.setattr("trl_flow.models.load_pipeline", lambda name, dtype, **kw: ("loaded", name, dtype, kw))
    assert cli._load_pipeline(script_args, config) == ("loaded", "org/model", "bfloat16", {})  # as before


# ------------------------------------------------------------------------------------------------ the docs
def _docs_callback(name: str):
    """The class ``name`` defined in a python block of docs/callbacks.md."""
    import re

    text = open(os.path.join(os.path.dirname(__file__), "..", "docs", "callbacks.md"), encoding="utf-8").read()
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if f"class {name}(" in b)
    namespace = {}
    exec(compile(block, "docs/callbacks.md", "exec"), namespace)
    return namespace[name]


def test_the_early_stopping_callback_of_the_docs_stops_and_resumes(tmp_path, fresh_pipe):
    stopping = _docs_callback("RewardEarlyStopping")
    never_better = stopping(patience=2, min_delta=1e9)  # no log beats the first: stop at the third
    trainer = _trainer(tmp_path, fresh_pipe, [never_better], max_steps=5, save_steps=1)
    trainer.train()
    assert trainer.state.global_step == 3 and never_better.bad_logs == 2
    assert os.path.isfile(tmp_path / "out" / "pytorch_lora_weights.safetensors")
    assert never_better.best == trainer.state.log_history[0]["reward"]
    patient = stopping(patience=10, min_delta=1e9)
    _trainer(tmp_path, fresh_pipe, [patient], max_steps=5, save_steps=1).train(
        resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert patient.bad_logs == 4 and patient.best == never_better.best  # 1 restored + 3 iterations


# ----------------------------------------------------------------------------------------- two processes
@pytest.mark.slow
def test_with_two_processes_the_main_process_flags_decide(tmp_path):
    import socket
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", ACCELERATE_USE_CPU="1")
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(here), here, env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           os.path.join(here, "callbacks_worker.py"), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)  # a deadlock fails here
    assert proc.returncode == 0, proc.stderr[-4000:]
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert seen[0] == seen[1] == {"global_step": 1, "events": [["on_train_end", 1]], "log_steps": [1]}
    assert not [n for n in os.listdir(tmp_path / "run") if n.startswith("checkpoint-")]
    assert os.path.isfile(tmp_path / "run" / "pytorch_lora_weights.safetensors")
