"""What a new user hits first: a second run never silently replaces the first, resume and save faults,
strict-JSON logs, rewards beyond float32, byte-identical LoRA files across fresh processes."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import warnings

import pytest
import torch
from conftest import PROMPTS, brightness, tiny_config

from trl_flow import FlowGRPOTrainer
from trl_flow import storage
from trl_flow.engine import checkpoints

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _trainer(tmp_path, fresh_pipe, rewards=None, **overrides):
    return FlowGRPOTrainer(tiny_config(tmp_path, **overrides), fresh_pipe(), rewards or [brightness],
                           train_dataset=list(PROMPTS))


def _lora(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


# ------------------------------------------------------------------------------------------- item 1: no overwrite
def test_a_finished_run_without_checkpoints_is_never_silently_replaced(tmp_path, fresh_pipe):
    out = tmp_path / "out"
    first = _trainer(tmp_path, fresh_pipe, max_steps=1, log_images_steps=1)
    first.train()
    first.save_model()
    lora = out / storage.LORA_WEIGHT_NAME
    saved = lora.read_bytes()
    log = (out / "log_history.jsonl").read_text()
    assert os.listdir(out / "samples")

    second = _trainer(tmp_path, fresh_pipe, max_steps=1, seed=7)
    with pytest.raises(ValueError) as info:
        second.train()
    msg = str(info.value)
    for name in (storage.LORA_WEIGHT_NAME, "log_history.jsonl", "samples/", "no complete checkpoint to resume",
                 "overwrite_output_dir=True"):
        assert name in msg
    assert "resume_from_checkpoint=True" not in msg  # nothing to resume: not offered
    assert lora.read_bytes() == saved and (out / "log_history.jsonl").read_text() == log  # nothing touched

    third = _trainer(tmp_path, fresh_pipe, max_steps=1, seed=7, overwrite_output_dir=True)
    third.train()
    assert not (out / "samples").exists()  # the old run's files are gone, none mixes in
    assert lora.read_bytes() != saved  # the final LoRA is the third run's (train() saves it)
    assert [json.loads(line)["step"] for line in (out / "log_history.jsonl").read_text().splitlines()] == [1]
    third.train()  # the same trainer again: its own outputs are not "an earlier run"


def test_overwrite_removes_the_earlier_runs_checkpoints(tmp_path, fresh_pipe):
    out = tmp_path / "out"
    _trainer(tmp_path, fresh_pipe, max_steps=2, save_steps=1).train()
    assert _names(out) == ["checkpoint-1", "checkpoint-2", "log_history.jsonl", storage.LORA_WEIGHT_NAME]
    with pytest.raises(ValueError, match="checkpoint-1, checkpoint-2, log_history.jsonl.*resume_from_checkpoint=True"):
        _trainer(tmp_path, fresh_pipe, max_steps=1).train()
    (out / "notes.txt").write_text("mine")
    _trainer(tmp_path, fresh_pipe, max_steps=1, save_steps=1, overwrite_output_dir=True).train()
    assert _names(out) == ["checkpoint-1", "log_history.jsonl", "notes.txt",  # only trl_flow's files were removed
                           storage.LORA_WEIGHT_NAME]


def _names(out) -> list[str]:
    """The folder's entries but the hidden run lock ``.trl_flow.lock``."""
    return sorted(n for n in os.listdir(out) if n != ".trl_flow.lock")


# ---------------------------------------------------------------------------------------------- item 7: resume
def _corrupt_newest(out):
    complete, _ = checkpoints.find_checkpoints(str(out))
    path = os.path.join(complete[-1].path, "scheduler.json")
    with open(path, "a") as f:
        f.write(" ")
    return complete


def test_resume_true_falls_back_past_a_corrupted_newest_checkpoint(tmp_path, fresh_pipe):
    out = tmp_path / "out"
    _trainer(tmp_path, fresh_pipe, max_steps=2, save_steps=1).train()
    _corrupt_newest(out)
    tr = _trainer(tmp_path, fresh_pipe, max_steps=2, save_steps=1)
    with pytest.warns(RuntimeWarning, match="skipping .*checkpoint-2.*scheduler.json is corrupted"):
        info = checkpoints.resolve_resume(True, str(out))
    assert info.step == 1
    with pytest.warns(RuntimeWarning, match="checkpoint-2"):
        tr.train(resume_from_checkpoint="True")  # the string a command line gives means True
    assert tr.state.global_step == 2
    checkpoints.verify_files(checkpoints.resolve_resume(str(out / "checkpoint-2"), str(out)))  # rewritten whole

    _corrupt_newest(out)
    tr = _trainer(tmp_path, fresh_pipe, max_steps=2)
    with pytest.raises(ValueError, match="checkpoint-2: file scheduler.json is corrupted"):
        tr.train(resume_from_checkpoint=str(out / "checkpoint-2"))  # a folder given explicitly stays an error


def test_an_interrupted_tmp_folder_is_refused_and_never_deleted_after_resume(tmp_path, fresh_pipe):
    out = tmp_path / "out"
    _trainer(tmp_path, fresh_pipe, max_steps=1, save_steps=1).train()
    tmp = out / "checkpoint-1.tmp"
    os.rename(out / "checkpoint-1", tmp)  # a save killed just before its rename (marker written)
    tr = _trainer(tmp_path, fresh_pipe, max_steps=2, save_steps=1, save_total_limit=1)
    with pytest.raises(ValueError, match="interrupted save"):
        tr.train(resume_from_checkpoint=str(tmp))
    assert tmp.is_dir()


def test_unwritable_output_dir_fails_before_any_compute(tmp_path, fresh_pipe):
    if os.geteuid() == 0:
        pytest.skip("root can write anywhere")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(ValueError, match="output_dir=.*not writable"):
            _trainer(tmp_path, fresh_pipe, output_dir=str(locked / "run"))
        tr = _trainer(tmp_path, fresh_pipe, max_steps=1)
        with pytest.raises(ValueError, match=r"save_model\(output_dir\)=.*not writable"):
            tr.save_model(str(locked))
    finally:
        locked.chmod(0o700)


def test_unwritable_output_dir_check_names_a_file_in_the_way(tmp_path, fresh_pipe):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="output_dir=.*is a file, not a folder"):
        _trainer(tmp_path, fresh_pipe, output_dir=str(tmp_path / "afile" / "run"))
    tr = _trainer(tmp_path, fresh_pipe, max_steps=1)
    with pytest.raises(ValueError, match=r"save_model\(output_dir\)"):
        tr.save_model(str(tmp_path / "afile"))


def test_saved_lora_files_follow_the_umask(tmp_path, fresh_pipe):
    old = os.umask(0o022)
    try:
        tr = _trainer(tmp_path, fresh_pipe, max_steps=1, save_steps=1, ema_decay=0.5)
        tr.train()
        tr.save_model(str(tmp_path / "final"))
    finally:
        os.umask(old)
    ckpt = tmp_path / "out" / "checkpoint-1"
    modes = {p: stat.S_IMODE(os.stat(p).st_mode) for p in (tmp_path / "final" / storage.LORA_WEIGHT_NAME,
                                                          ckpt / storage.LORA_WEIGHT_NAME,
                                                          ckpt / "ema.safetensors", ckpt / "trainer_state.json")}
    assert set(modes.values()) == {0o644}, modes


# ------------------------------------------------------------------------------------------- item 7: the log
def test_log_history_is_strict_json_with_null_for_nan(tmp_path, fresh_pipe):
    def nothing(images, prompts, **kw):
        return [None] * len(prompts)

    tr = _trainer(tmp_path, fresh_pipe, rewards=[nothing], max_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr.train()
    text = (tmp_path / "out" / "log_history.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text

    def strict(s):
        raise ValueError(f"non-standard JSON constant {s}")

    entry = json.loads(text.splitlines()[0], parse_constant=strict)
    assert entry["reward"] is None and entry["no_reward_frac"] == 1.0


# ----------------------------------------------------------------------------------- item 7: rewards > float32
@pytest.mark.parametrize("value,weight", [(1e39, 1.0), (1e38, 10.0), (1e308, 1.0), (-1e308, 1.0)])
def test_a_reward_beyond_float32_skips_that_sample_not_the_run(tmp_path, fresh_pipe, value, weight):
    def huge_once(images, prompts, **kw):
        out = images.mean(dim=(1, 2, 3)).tolist()
        if len(out) == 8:  # training batches (the set-up check calls it on 2 grey images)
            out[3] = value
        return out

    tr = _trainer(tmp_path, fresh_pipe, rewards=[huge_once], max_steps=2, reward_weights=[weight])
    before = _lora(tr)
    with pytest.warns(RuntimeWarning, match="float32"):
        tr.train()
    log = tr.state.log_history
    assert all(h["nonfinite_skipped"] == 0 for h in log)
    assert all(h["rewards/huge_once_none_frac"] == pytest.approx(1 / 8) or weight != 1.0 for h in log)
    assert all(h["no_reward_frac"] == pytest.approx(1 / 8) for h in log)
    assert all(h["reward"] is not None and abs(h["reward"]) <= weight for h in log)
    assert any(not torch.equal(before[n], p) for n, p in _lora(tr).items())  # it trained


def test_a_skipped_non_finite_update_is_announced(tmp_path, fresh_pipe, monkeypatch):
    tr = _trainer(tmp_path, fresh_pipe, max_steps=1)
    real = tr.compute_loss

    def nan_loss(*a, **k):
        loss, stats = real(*a, **k)
        return loss * float("nan"), stats

    monkeypatch.setattr(tr, "compute_loss", nan_loss)
    with pytest.warns(RuntimeWarning, match="non-finite loss / gradient update.*skipped"):
        tr.train()


# --------------------------------------------------------------------------------- item 3: reproducible files
_CHILD = r"""
import sys, torch
sys.path.insert(0, {tests!r})
torch.set_num_threads(int(sys.argv[2]))
from conftest import PROMPTS, brightness, tiny_config
from trl_flow import FlowGRPOTrainer
from trl_flow.testing import tiny_sd3_pipeline
import pathlib
tr = FlowGRPOTrainer(tiny_config(pathlib.Path(sys.argv[1]), max_steps=2), tiny_sd3_pipeline(), [brightness],
                     train_dataset=list(PROMPTS))
tr.train()
tr.save_model()
"""


def _read_safetensors(path):
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = {k: json.loads(v) if k == "lora_adapter_metadata" else v for k, v in (f.metadata() or {}).items()}
        return meta, {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.slow
def test_two_fresh_processes_write_identical_lora_weights_and_metadata(tmp_path):
    """Same seed, same thread count, two fresh processes with different string hash seeds: identical tensors and
    identical adapter metadata (its target_modules set used to be written in hash order). The files' bytes may
    still differ in the order of the header's metadata keys, which safetensors serialises from a Rust hash map."""
    script = tmp_path / "child.py"
    script.write_text(_CHILD.format(tests=os.path.join(ROOT, "tests")))
    runs = []
    for i, hashseed in enumerate(("1", "2")):
        env = {**os.environ, "PYTHONHASHSEED": hashseed, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
        subprocess.run([sys.executable, str(script), str(tmp_path / f"run{i}"), "1"], check=True, env=env,
                       capture_output=True, timeout=300)
        runs.append(_read_safetensors(tmp_path / f"run{i}" / "out" / storage.LORA_WEIGHT_NAME))
    (meta0, t0), (meta1, t1) = runs
    assert meta0 == meta1
    assert list(meta0["lora_adapter_metadata"]["transformer.target_modules"]) == sorted(
        meta0["lora_adapter_metadata"]["transformer.target_modules"])
    assert t0.keys() == t1.keys() and all(torch.equal(t0[k], t1[k]) for k in t0)


# --------------------------------------------------------------------------------------- item 4: said once
def test_a_multi_process_run_says_once_how_many_processes(monkeypatch, capsys, tmp_path):
    """One start-up line a user understands (how many processes, on what, how they share the work, precision),
    printed by the main process only (accelerate's print), in place of `accelerate NO, 1 process(es)`."""
    from trl_flow.engine import distributed, guards

    line = distributed.startup_line
    assert line({"distributed_type": "NO", "num_processes": 1}, "cpu") == (
        "trl_flow: training on 1 process on cpu, float32")
    assert line({"distributed_type": "MULTI_CPU", "num_processes": 2}, "cpu") == (
        "trl_flow: training on 2 CPU processes, data parallel (DDP over gloo), float32")
    assert line({"distributed_type": "MULTI_GPU", "num_processes": 8}, "cuda:3", "bf16") == (
        "trl_flow: training on 8 CUDA processes, data parallel (DDP over NCCL), bf16 mixed precision")
    assert line({"distributed_type": "FSDP", "num_processes": 2, "fsdp_version": 2, "fsdp_state_dict_type":
                 "SHARDED_STATE_DICT", "fsdp_on_cpu": True}, "cpu") == (
        "trl_flow: training on 2 CPU processes, parameters sharded (FSDP2, sharded_state_dict checkpoints), float32")
    from trl_flow import FlowGRPOConfig

    distributed.make_accelerator(FlowGRPOConfig(output_dir=str(tmp_path)))
    assert capsys.readouterr().out.splitlines() == ["trl_flow: training on 1 process on cpu, float32"]

    class FakeAccelerator:  # a launch whose processes accelerate joined: no error, nothing more printed
        num_processes, out = 2, []

        def print(self, *a):
            self.out.append(a)

    monkeypatch.setenv("WORLD_SIZE", "2")
    guards.check_launch(FakeAccelerator())
    assert FakeAccelerator.out == []


def test_a_normal_run_warns_nothing(tmp_path, fresh_pipe, caplog):
    """A healthy run (train, checkpoint, resume, save) raises no Python warning and logs no warning record."""
    import logging

    caplog.set_level(logging.WARNING)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _trainer(tmp_path, fresh_pipe, max_steps=1, save_steps=1).train()
        tr = _trainer(tmp_path, fresh_pipe, max_steps=2, save_steps=1)
        tr.train(resume_from_checkpoint=True)
        tr.save_model(str(tmp_path / "final"))
    assert [str(w.message) for w in seen] == []
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
