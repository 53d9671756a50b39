"""Checkpoints: diffusers-loadable LoRA and no pickled objects; the newest complete checkpoint is resumed and
incomplete ones are skipped; corrupted files are named; runs are kept apart (run ids, rotation by time, another
run's output_dir); changed settings on resume; SIGINT / SIGTERM save the last complete iteration; random kills of
a child process, then resumes, end bit-identical to an uninterrupted run."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import PROMPTS, brightness

from trl_flow.engine import checkpoints
from trl_flow.engine.interrupts import InterruptGuard

HERE = os.path.dirname(os.path.abspath(__file__))


def _ckpts(out) -> list[str]:
    return sorted(n for n in os.listdir(out) if n.startswith("checkpoint-"))


def _lora(trainer):
    return {n: p.detach().clone() for n, p in trainer.pipe.transformer.named_parameters() if "lora_" in n}


def _log_steps(out) -> list[int]:
    return [json.loads(line)["step"] for line in open(os.path.join(out, "log_history.jsonl"))]


def test_checkpoint_loads_in_diffusers_and_holds_no_pickled_objects(make_trainer, fresh_pipe, tmp_path):
    tr = make_trainer(max_steps=1, save_steps=1, lora_r=4, lora_alpha=8, ema_decay=0.5)
    tr.train()
    ckpt = tmp_path / "out" / "checkpoint-1"
    files = set(os.listdir(ckpt))
    assert {"pytorch_lora_weights.safetensors", "checkpoint_complete.json", "trainer_state.json", "scheduler.json",
            "trainer_config.json", "ema.safetensors", "ema.json", "optimizer.bin"} <= files
    assert not any(f.startswith("custom_checkpoint") for f in files)  # accelerate pickles registered objects
    pipe = fresh_pipe()
    pipe.load_lora_weights(str(ckpt))  # the diffusers way
    loaded = {n.replace(".default_0.", ".default."): p for n, p in pipe.transformer.named_parameters() if "lora_" in n}
    trained = _lora(tr)
    assert loaded.keys() == trained.keys() and all(torch.equal(loaded[n], trained[n]) for n in trained)
    assert pipe.transformer.peft_config["default_0"].lora_alpha == 8  # alpha != r round-trips


def test_resume_takes_the_newest_complete_checkpoint_and_skips_incomplete_ones(make_trainer, tmp_path):
    out = tmp_path / "out"
    make_trainer(max_steps=2, save_steps=1).train()
    shutil.copytree(out / "checkpoint-2", out / "checkpoint-3")
    os.remove(out / "checkpoint-3" / checkpoints.COMPLETE_NAME)  # e.g. copied by hand, or an older writer
    shutil.copytree(out / "checkpoint-2", out / "checkpoint-4.tmp")  # a save killed before its rename
    with pytest.raises(ValueError, match="checkpoint-3 is not a complete trl_flow checkpoint.*checkpoint-2"):
        make_trainer(max_steps=3).train(resume_from_checkpoint=str(out / "checkpoint-3"))
    tr = make_trainer(max_steps=3, save_steps=1)
    with pytest.warns(RuntimeWarning, match="skipping incomplete checkpoint") as warned:
        tr.train(resume_from_checkpoint=True)
    assert {os.path.basename(str(w.message).split()[4]) for w in warned if "skipping" in str(w.message)} == {
        "checkpoint-3", "checkpoint-4.tmp"}
    assert [h["step"] for h in tr.state.log_history] == [1, 2, 3]  # resumed at 2, not 3 or 4
    assert not os.path.exists(out / "checkpoint-4.tmp")  # leftovers of interrupted saves are cleaned
    assert _log_steps(out) == [1, 2, 3]


def test_missing_or_corrupted_file_is_named(make_trainer, tmp_path):
    out = tmp_path / "out"
    make_trainer(max_steps=1, save_steps=1).train()
    ckpt = out / "checkpoint-1"
    def flip_byte():
        with open(ckpt / "optimizer.bin", "r+b") as f:
            f.seek(200)
            byte = f.read(1)
            f.seek(200)
            f.write(bytes([byte[0] ^ 0xFF]))

    flip_byte()
    with pytest.raises(ValueError, match="optimizer.bin is corrupted"):
        make_trainer(max_steps=2).train(resume_from_checkpoint=True)
    flip_byte()  # repaired
    os.remove(ckpt / "pytorch_lora_weights.safetensors")
    with pytest.raises(ValueError, match="pytorch_lora_weights.safetensors is missing"):
        make_trainer(max_steps=2).train(resume_from_checkpoint=str(ckpt))


def test_runs_are_kept_apart_and_rotation_is_by_step_within_a_run(make_trainer, tmp_path, capsys):
    out = tmp_path / "out"
    a = make_trainer(max_steps=3, save_steps=1)
    a.train()
    with pytest.raises(ValueError, match="already holds an earlier run's outputs.*overwrite_output_dir"):
        make_trainer(max_steps=2, save_steps=1).train()
    import shutil

    shutil.copytree(out / "checkpoint-3", tmp_path / "a-checkpoint-3")
    b = make_trainer(max_steps=2, save_steps=1, save_total_limit=1, overwrite_output_dir=True, seed=7)
    b.train()
    ids = {n: checkpoints.read_marker(str(out / n)).run_id for n in _ckpts(out)}
    # the overwrite removed a's checkpoints; b rotated its own checkpoint-1
    assert ids == {"checkpoint-2": b.state.run_id}
    shutil.copytree(tmp_path / "a-checkpoint-3", out / "checkpoint-3")  # an older run's, with a higher step
    assert _log_steps(out) == [1, 2]  # b's log only
    resumed = make_trainer(max_steps=3, seed=7)
    capsys.readouterr()
    with pytest.warns(RuntimeWarning, match="holds checkpoints of 2 runs; resuming the highest step, checkpoint-3"):
        resumed.train(resume_from_checkpoint=True)  # newest by step, never by the clock: a's checkpoint-3
    assert "checkpoint-3 (step 3, run " + a.state.run_id in capsys.readouterr().out
    assert resumed.state.run_id == a.state.run_id and resumed.state.global_step == 3


def test_changed_settings_on_resume(make_trainer, tmp_path, capsys):
    from trl_flow import OPGRPOConfig, OPGRPOTrainer

    out = tmp_path / "out"
    make_trainer(max_steps=1, save_steps=1).train()
    ckpt = str(out / "checkpoint-1")
    for change, field, old, new in [({"lora_r": 8}, "lora_r", 4, 8), ({"lora_alpha": 4}, "lora_alpha", 8, 4),
                                    ({"num_generations": 2}, "num_generations", 4, 2),
                                    ({"sampler": "cps"}, "sampler", "'flow_sde'", "'cps'")]:
        tr = make_trainer(max_steps=2, **change)
        with pytest.raises(ValueError, match=f"{field}: {old} -> {new}"):
            tr.load_checkpoint(ckpt)
    from conftest import tiny_config

    from trl_flow.testing import tiny_sd3_pipeline

    op = OPGRPOTrainer(tiny_config(tmp_path, OPGRPOConfig, max_steps=2, off_policy_fraction=0.5),
                       tiny_sd3_pipeline(), [brightness], train_dataset=PROMPTS)
    with pytest.raises(ValueError, match="method 'flow_grpo'.*'op_grpo'"):
        op.load_checkpoint(ckpt)

    # harmless changes: accepted without a word
    tr = make_trainer(max_steps=5, logging_steps=2, save_steps=3, eval_steps=0, output_dir=str(tmp_path / "other"))
    capsys.readouterr()
    tr.load_checkpoint(ckpt)
    assert "Changed settings" not in capsys.readouterr().out
    # a new learning rate and schedule are applied to the restored optimizer, and said so
    tr = make_trainer(max_steps=4, learning_rate=5e-4, lr_scheduler_type="linear", beta=0.01)
    tr.load_checkpoint(ckpt)
    said = capsys.readouterr().out
    assert "learning_rate: 0.001 -> 0.0005" in said and "lr_scheduler_type: 'constant' -> 'linear'" in said
    assert "beta: 0.0 -> 0.01" in said
    opt_steps = tr.lr_scheduler.last_epoch
    assert opt_steps == 2  # 1 iteration x 2 microbatches of 4 (no accumulation)
    expected = 5e-4 * (tr.config.max_steps * tr.optimizer_steps_per_iteration - opt_steps) / (
        tr.config.max_steps * tr.optimizer_steps_per_iteration)
    assert tr.optimizer.param_groups[0]["lr"] == pytest.approx(expected)
    assert tr.lr_scheduler.get_last_lr()[0] == pytest.approx(expected)


def _signal_during_iteration(sig, times=1):
    calls = {"n": 0}

    def reward(images, prompts, **kw):
        calls["n"] += 1
        if calls["n"] == 3:  # 1: the constructor's check, 2: iteration 1, 3: iteration 2
            for i in range(times):
                if i:  # a second press, not a copy of the first (copies within COALESCE_S count once)
                    time.sleep(InterruptGuard.COALESCE_S + 0.3)
                os.kill(os.getpid(), sig)
        return brightness(images, prompts)

    return reward


def test_sigterm_saves_the_last_complete_iteration_and_exits_143(make_trainer, tmp_path):
    out = tmp_path / "out"
    tr = make_trainer(rewards=[_signal_during_iteration(signal.SIGTERM)], max_steps=4, save_steps=3)
    with pytest.raises(SystemExit) as info:
        tr.train()
    assert info.value.code == 128 + signal.SIGTERM
    assert _ckpts(out) == ["checkpoint-2"] and checkpoints.read_marker(str(out / "checkpoint-2")) is not None
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored


def test_a_second_ctrl_c_stops_at_once_and_keeps_the_last_checkpoint(make_trainer, tmp_path):
    out = tmp_path / "out"
    tr = make_trainer(rewards=[_signal_during_iteration(signal.SIGINT, times=2)], max_steps=4, save_steps=1)
    with pytest.raises(KeyboardInterrupt):
        tr.train()
    assert tr.state.global_step == 1 and _ckpts(out) == ["checkpoint-1"]  # nothing of iteration 2 was saved
    checkpoints.verify_files(checkpoints.read_marker(str(out / "checkpoint-1")))


def _run_child(out, max_steps, hang_at=0, reward_seconds=0.0):
    return subprocess.Popen([sys.executable, os.path.join(HERE, "checkpoints_child.py"), str(out), str(max_steps),
                             str(hang_at), str(reward_seconds)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
                                     PYTHONPATH=os.pathsep.join([os.path.dirname(HERE),
                                                                 os.environ.get("PYTHONPATH", "")])))


def _wait_for(proc, prefix) -> bool:
    for line in proc.stdout:
        if line.startswith(prefix):
            return True
    return False


def _newest(out) -> int:
    complete, _ = checkpoints.find_checkpoints(str(out))
    return complete[-1].step if complete else 0


@pytest.mark.slow
def test_random_kills_then_resume_end_bit_identical_to_an_uninterrupted_run(tmp_path):
    """An OP-GRPO child is killed with SIGKILL in the middle of a save, then with SIGTERM and SIGKILL at a random
    moment after its first save (inside that save or in the next iteration, which lasts at least 0.4 s: the reward
    sleeps), restarted each time from the newest
    complete checkpoint, and finally run to the end. (SIGINT is deferred like SIGTERM: tested in-process.)"""
    import multiprocess_worker as mw
    from safetensors.torch import load_file

    import trl_flow

    steps, out, rng = 6, tmp_path / "killed", random.Random(0)
    proc = _run_child(out, steps, hang_at=2)  # the save of checkpoint-2 stops half-way
    assert _wait_for(proc, "SAVE 2")
    proc.kill()
    proc.communicate(timeout=300)
    assert _ckpts(out) == ["checkpoint-1", "checkpoint-2.tmp"]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        before = _newest(out)
        proc = _run_child(out, steps, reward_seconds=0.4)
        assert _wait_for(proc, f"SAVE {before + 1}")
        time.sleep(rng.uniform(0.0, 0.3))
        proc.send_signal(sig)
        rest, _ = proc.communicate(timeout=300)
        assert "DONE" not in rest, sig  # really interrupted
        if sig == signal.SIGTERM:  # deferred: the iteration was finished and saved, then exit status 143
            assert proc.returncode == 143 and not any(n.endswith(".tmp") for n in _ckpts(out))
            assert before < _newest(out) < steps
        else:  # a SIGKILL inside the save of checkpoint-<before + 1> leaves it incomplete
            assert before <= _newest(out) < steps
    proc = _run_child(out, steps)
    assert _wait_for(proc, "DONE"), "the last child did not finish"
    proc.communicate(timeout=300)

    ref = mw.make_trainer(trl_flow.OPGRPOTrainer, str(tmp_path / "ref"), max_steps=steps)
    ref.train()
    got = load_file(str(out / f"checkpoint-{steps}" / "pytorch_lora_weights.safetensors"))
    want = load_file(str(tmp_path / "ref" / f"checkpoint-{steps}" / "pytorch_lora_weights.safetensors"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), "final LoRA differs"
    bufs = [mw.buffer_hash(type("T", (), {"replay_buffer": trl_flow.ReplayBuffer.load_from_disk(
        str(d / f"checkpoint-{steps}" / "replay_buffer"))})()) for d in (out, tmp_path / "ref")]
    assert bufs[0] == bufs[1]
    logged = [json.loads(line) for line in open(out / "log_history.jsonl")]
    assert [e["step"] for e in logged] == list(range(1, steps + 1))  # no duplicate steps
    assert [e["reward"] for e in logged] == [e["reward"] for e in ref.state.log_history]


def test_nothing_is_unpickled_outside_torch_load_weights_only(make_trainer):
    """No pickle / eval / exec in the package, torch.load only with weights_only=True; accelerate gets no custom
    objects to pickle (it reads those back with weights_only=False)."""
    import re

    import trl_flow

    root = os.path.dirname(trl_flow.__file__)
    pattern = re.compile(r"\bpickle\b|\bdill\b|(?<![.\w])(eval|exec)\(|\bweights_only\s*=\s*False")
    hits = []
    for dirpath, _, names in os.walk(root):
        for name in names:
            if name.endswith(".py"):
                for i, line in enumerate(open(os.path.join(dirpath, name), encoding="utf-8"), 1):
                    code = line.split("#")[0]
                    if "``" not in line and (pattern.search(code) or (
                            "torch.load(" in code and "weights_only=True" not in code)):
                        hits.append(f"{name}:{i}: {line.strip()}")
    assert not hits, hits
    assert make_trainer().accelerator._custom_objects == []
