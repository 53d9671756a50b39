"""What the schedulers people run on do to a run, and that nothing is lost (docs/reliability.md, "Under a
scheduler"): one SIGTERM delivered several times (the process's own and the launcher's forward) counts once; a
SIGTERM writes the last completed iteration within seconds, before a short grace period ends in SIGKILL."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import brightness
from test_multiprocess_stop import HANG, ROOT, _free_port, _output, _popen, _wait_until

from trl_flow import storage
from trl_flow.engine import checkpoints


def _ckpts(out) -> list[str]:
    return sorted(n for n in os.listdir(out) if n.startswith("checkpoint-"))


def _lora(trainer):
    return {n: p.detach().clone() for n, p in trainer.pipe.transformer.named_parameters() if "lora_" in n}


# ------------------------------------------------------------------------------- one signal, several copies
def _sigterm_copies_in_iteration(at_call: int, copies: int, gap: float = 0.05):
    """A reward that sends ``copies`` SIGTERMs ``gap`` s apart to this process in its ``at_call``-th call (1: the
    constructor's check, 2: iteration 1, ...): what a scheduler's SIGTERM plus the launcher's forward look like."""
    calls = {"n": 0}

    def reward(images, prompts, **kw):
        calls["n"] += 1
        if calls["n"] == at_call:
            for i in range(copies):
                if i:
                    time.sleep(gap)
                os.kill(os.getpid(), signal.SIGTERM)
        return brightness(images, prompts)

    return reward


def test_copies_of_one_sigterm_count_once_the_iteration_is_finished_and_saved(make_trainer, tmp_path):
    """Two deliveries 50 ms apart (the process's own SIGTERM and the launcher's forward): the iteration is
    finished and saved, exit status 143; before, the second copy meant "stop now" and nothing was saved."""
    out = tmp_path / "out"
    tr = make_trainer(rewards=[_sigterm_copies_in_iteration(3, copies=2)], max_steps=4, save_steps=0)
    with pytest.raises(SystemExit) as info:
        tr.train()
    assert info.value.code == 128 + signal.SIGTERM
    assert tr.state.global_step == 2
    assert _ckpts(out) == ["checkpoint-2"]
    checkpoints.verify_files(checkpoints.read_marker(str(out / "checkpoint-2")))


def test_a_copy_whose_handler_runs_late_is_still_a_copy():
    """The handler runs when the main thread next runs Python: a launcher's copy that arrived 5 ms after the first
    SIGTERM can reach it seconds later (the main thread was in a collective). The watcher read both deliveries as
    they arrived and found one signal: that call is a copy, not "stop now" (before: the handler's own 5 s gap made
    it a second signal, and a 2-process run under load lost its iteration, 1 run in 3). A delivery the watcher has
    not read yet is judged by the handler's times, and two signals the watcher saw apart are a second signal."""
    from types import SimpleNamespace

    from trl_flow.engine.interrupts import InterruptGuard

    guard = InterruptGuard(print_fn=lambda *a: None)
    guard._first_at, guard._handled = 100.0, 2
    guard._watcher = SimpleNamespace(distinct=1, seen=2)
    assert not guard._is_second_signal(105.0)
    guard._watcher = SimpleNamespace(distinct=1, seen=1)  # the watcher has not read this delivery yet
    assert guard._is_second_signal(105.0) and not guard._is_second_signal(100.5)
    guard._watcher = SimpleNamespace(distinct=2, seen=2)
    assert guard._is_second_signal(100.5)


# ------------------------------------------------------------------------------- 2 processes, all signalled
CLUSTER_REWARD = '''
import os, time

calls = 0

def slow_reward(images, prompts, **kwargs):
    """brightness; iteration STOP_TEST_ITERATION takes STOP_TEST_SLEEP s longer (`started-<rank>` holds the pid)."""
    global calls
    calls += 1
    if calls == 1 + int(os.environ["STOP_TEST_ITERATION"]):  # 1: the constructor's check
        rank, where = os.environ["RANK"], os.environ["STOP_TEST_DIR"]
        with open(os.path.join(where, f"started-{rank}"), "w") as f:
            f.write(str(os.getpid()))
        time.sleep(float(os.environ["STOP_TEST_SLEEP"]))
        open(os.path.join(where, f"finished-{rank}"), "w").close()
    return images.mean(dim=(1, 2, 3)).tolist()
'''


def _cluster_run(tmp_path, launcher: str, iteration: int, sleep: float, **env_extra):
    """A 2-process run; while both processes are in iteration ``iteration`` (which takes ``sleep`` s more) every
    process -- the launcher and both workers -- gets SIGTERM at once, as from Slurm (time limit, scancel) or
    systemd. Returns (launcher process, markers folder, output folder, seconds from the signal to the exit)."""
    (tmp_path / "cluster_rewards.py").write_text(CLUSTER_REWARD)
    markers, out = tmp_path / "markers", tmp_path / "out"
    markers.mkdir()
    env = dict(os.environ, ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               STOP_TEST_DIR=str(markers), STOP_TEST_SLEEP=str(sleep), STOP_TEST_ITERATION=str(iteration),
               PYTHONPATH=os.pathsep.join([ROOT, str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    env.pop("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", None)
    env.update(env_extra)
    args = ["--config", "shapes_flow_grpo", "--reward_funcs", "cluster_rewards:slow_reward", "--max_steps", "3",
            "--eval_steps", "0", "--save_steps", "0", "--prompts_per_step", "2", "--num_generations", "2",
            "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1", "--disable_tqdm", "true",
            "--output_dir", str(out)]
    port = str(_free_port())
    if launcher == "trl-flow":
        cmd = [sys.executable, "-m", "trl_flow.cli", "grpo", "--accelerate_config", "multi_gpu", "--num_processes",
               "2", "--main_process_port", port, *args]
    else:  # a direct `accelerate launch`
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--main_process_port", port, "-m", "trl_flow.cli", "grpo", *args]
    proc = _popen(cmd, env, tmp_path, "launcher")
    started = [markers / f"started-{r}" for r in (0, 1)]
    _wait_until(lambda: all(p.exists() and p.read_text() for p in started), [proc], f"iteration {iteration}")
    pids = [proc.pid] + [int(p.read_text()) for p in started]
    t0 = time.monotonic()
    for pid in pids:  # everything at once
        os.kill(pid, signal.SIGTERM)
    try:
        proc.wait(timeout=HANG)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the launcher did not stop: {_output(proc)[-3000:]}")
    return proc, markers, out, time.monotonic() - t0


def test_sigterm_to_every_process_of_a_2_process_run_finishes_and_saves_the_iteration(tmp_path):
    """Slurm / systemd signal every process: each worker gets its own SIGTERM and the launcher's forward a few
    ms later. Both count once: the iteration is finished and saved as checkpoint-1, exit 143 (before: each worker
    took the forward as "stop now" and exited 3-4 s later with nothing saved)."""
    proc, markers, out, _ = _cluster_run(tmp_path, "trl-flow", iteration=1, sleep=5)
    log = _output(proc)
    assert proc.returncode == 143, log[-3000:]
    assert all((markers / f"finished-{r}").exists() for r in (0, 1)), log[-3000:]
    assert "after iteration 1; stopping" in log, log[-3000:]
    assert _ckpts(out) == ["checkpoint-1"]
    checkpoints.verify_files(checkpoints.read_marker(str(out / "checkpoint-1")))
    assert [json.loads(line)["step"] for line in open(out / "log_history.jsonl")] == [1]


# ------------------------------------------------------------------------------- preemption checkpoint
def test_sigterm_writes_the_last_completed_iteration_within_seconds_and_it_resumes_exactly(make_trainer, tmp_path):
    """SIGTERM in iteration 3: checkpoint-2 (not a save step) is complete within seconds while iteration 3 is still
    running (a scheduler's SIGKILL may come before its end); resumed, it ends bit-identical to an uninterrupted run.
    The stop's own checkpoint-3 then supersedes it. Before, nothing was written until the iteration's end."""
    out, kept = tmp_path / "out", tmp_path / "kept"
    seen = {}

    def reward(images, prompts, **kw):
        reward.calls += 1
        if reward.calls == 4:  # 1: the constructor's check, 2-3: iterations 1-2, 4: iteration 3
            t0 = time.monotonic()
            os.kill(os.getpid(), signal.SIGTERM)
            while time.monotonic() - t0 < 30 and checkpoints.read_marker(str(out / "checkpoint-2")) is None:
                time.sleep(0.02)
            seen["seconds"] = time.monotonic() - t0
            if (out / "checkpoint-2").exists():
                import shutil

                shutil.copytree(out / "checkpoint-2", kept / "checkpoint-2")  # what a SIGKILL now would leave
        return brightness(images, prompts)

    reward.calls = 0
    tr = make_trainer(rewards=[reward], max_steps=4, save_steps=0, ema_decay=0.5)
    with pytest.raises(SystemExit) as info:
        tr.train()
    assert info.value.code == 128 + signal.SIGTERM
    assert seen["seconds"] < 10, seen
    marker = json.load(open(kept / "checkpoint-2" / checkpoints.COMPLETE_NAME))
    assert marker["step"] == 2 and marker["preemption"] is True
    assert _ckpts(out) == ["checkpoint-3"]  # the stop saved iteration 3; the preemption checkpoint is superseded

    resumed = make_trainer(max_steps=3, save_steps=0, ema_decay=0.5, output_dir=str(kept))
    resumed.train(resume_from_checkpoint=True)
    ref = make_trainer(max_steps=3, save_steps=0, ema_decay=0.5, output_dir=str(tmp_path / "ref"))
    ref.train()
    got, want = _lora(resumed), _lora(ref)
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
    assert [h["reward"] for h in resumed.state.log_history] == [h["reward"] for h in ref.state.log_history]


def test_a_grace_shorter_than_the_iteration_still_leaves_the_last_completed_one(tmp_path):
    """A direct `accelerate launch` with a 3 s shutdown timeout (torch's is 30 s, as Slurm's KillWait), SIGTERM to
    every process during a 20 s iteration 2: the launcher SIGKILLs both workers, and checkpoint-1 is complete on
    disk (before: nothing was saved)."""
    proc, markers, out, _ = _cluster_run(tmp_path, "accelerate", iteration=2, sleep=20,
                                         TORCH_ELASTIC_SHUTDOWN_TIMEOUT="3")
    log = _output(proc)
    assert proc.returncode == 143, log[-3000:]
    assert not any((markers / f"finished-{r}").exists() for r in (0, 1))  # killed inside iteration 2
    assert _ckpts(out) == ["checkpoint-1"], log[-3000:]
    checkpoints.verify_files(checkpoints.read_marker(str(out / "checkpoint-1")))
    assert "SIGTERM: saved" in log and "(iteration 1, the last completed one)" in log


# ------------------------------------------------------------------------------- clock skew
class _SkewedClock:
    """``time`` for checkpoints.py whose ``time()`` goes back ``back_s`` seconds at every call after ``after``
    calls (a machine whose clock is behind the one that wrote the earlier checkpoints, or NTP setting it back)."""

    def __init__(self, back_s: float, after: int = 0):
        self.back_s, self.after, self.calls, self.base = back_s, after, 0, time.time()

    def time(self) -> float:
        self.calls += 1
        return self.base - self.back_s * max(0, self.calls - self.after)

    def __getattr__(self, name):
        return getattr(time, name)


def test_rotation_keeps_the_newest_steps_when_the_clock_goes_back(make_trainer, tmp_path, monkeypatch):
    """An hour back at every save, save_total_limit=2: the two highest steps are kept (before: each new checkpoint
    was the 'oldest' and was deleted by rotation at once)."""
    monkeypatch.setattr(checkpoints, "time", _SkewedClock(3600))
    make_trainer(max_steps=4, save_steps=1, save_total_limit=2).train()
    assert _ckpts(tmp_path / "out") == ["checkpoint-3", "checkpoint-4"]


def test_resume_true_takes_the_highest_step_when_the_clock_went_back(make_trainer, tmp_path, monkeypatch):
    """The clock goes back 10 min after checkpoint-4 (checkpoints 5 and 6 look older): resume_from_checkpoint=True
    continues from checkpoint-6 and sets nothing aside (before: it resumed checkpoint-4 and moved 5 and 6 into an
    'abandoned branch')."""
    out = tmp_path / "out"
    monkeypatch.setattr(checkpoints, "time", _SkewedClock(600, after=4))
    make_trainer(max_steps=6, save_steps=1).train()
    tr = make_trainer(max_steps=7, save_steps=1)
    tr.train(resume_from_checkpoint=True)
    assert [h["step"] for h in tr.state.log_history] == list(range(1, 8))
    assert _ckpts(out) == [f"checkpoint-{n}" for n in range(1, 8)]
    assert not [n for n in os.listdir(out) if n.startswith(checkpoints.ABANDONED_PREFIX)]


# ------------------------------------------------------------------------------- someone else's files
def test_overwrite_refuses_a_base_model_folder_and_names_what_it_holds(make_trainer, fresh_pipe, tmp_path):
    """output_dir = the base model's folder (a pipeline no trl_flow run wrote): refused even with
    overwrite_output_dir, naming its components; nothing is deleted (before: transformer/, vae/, the text encoders,
    tokenizers and scheduler were deleted)."""
    base = tmp_path / "base"
    fresh_pipe().save_pretrained(str(base))
    before = sorted(os.listdir(base))
    with pytest.raises(ValueError, match=r"holds a diffusers pipeline that no trl_flow run wrote \(model_index.json, "
                                         r".*transformer/.*vae/.*not even with overwrite_output_dir"):
        make_trainer(max_steps=1, output_dir=str(base), overwrite_output_dir=True).train()
    assert sorted(n for n in os.listdir(base) if n != ".trl_flow.lock") == before


def test_overwrite_lists_every_path_it_removes_before_removing_it(make_trainer, tmp_path, capsys):
    """An earlier trl_flow run's saved pipeline, one component a symlink: the overwrite names each component folder
    and the symlink before removing them (before: only model_index.json was named); the link's target is kept."""
    out = tmp_path / "out"
    make_trainer(finetune="full", max_steps=1).train()
    target = tmp_path / "elsewhere"
    shutil.move(str(out / "scheduler"), str(target))
    os.symlink(target, out / "scheduler")
    capsys.readouterr()
    make_trainer(max_steps=1, overwrite_output_dir=True).train()
    said = capsys.readouterr().out
    line = next(ln for ln in said.splitlines() if ln.startswith("overwrite_output_dir: removing from"))
    for name in ("model_index.json", "transformer/", "vae/", "text_encoder/", "tokenizer/",
                 "scheduler (symlink, its target is kept)", "log_history.jsonl"):
        assert name in line, (name, line)
    assert said.index("overwrite_output_dir: removing from") < said.index("overwrite_output_dir: removed")
    assert target.is_dir() and not (out / "transformer").exists()


# ------------------------------------------------------------------------------- disk full at the end
def test_a_failed_final_save_writes_the_weights_to_a_fallback_folder_it_names(make_trainer, tmp_path, monkeypatch):
    """The disk of output_dir is full at the final save: the weights go to $TRL_FLOW_RESCUE_DIR/<run> and the error
    names it (before: from the command line every trained weight was lost with the process)."""
    import errno

    import safetensors.torch

    out, rescue = tmp_path / "out", tmp_path / "rescue"
    monkeypatch.setenv("TRL_FLOW_RESCUE_DIR", str(rescue))
    real = safetensors.torch.save_file

    def save_file(obj, path, *a, **k):
        if str(path).startswith(str(out)):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(obj, path, *a, **k)

    tr = make_trainer(max_steps=1)
    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    with pytest.raises(storage.SaveError, match="written to the fallback folder") as info:
        tr.train()
    folder = next(p for p in rescue.iterdir())
    assert str(folder) in str(info.value) and "is full" in str(info.value)
    monkeypatch.setattr(safetensors.torch, "save_file", real)
    again = tr.save_model(str(tmp_path / "again"))  # the same weights, written normally
    got, want = (safetensors.torch.load_file(os.path.join(d, storage.LORA_WEIGHT_NAME)) for d in (folder, again))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_a_disk_too_small_for_the_weights_is_refused_at_the_start(make_trainer, tmp_path, monkeypatch):
    """Free space below the final weights' size: refused before any compute, naming check_free_space (which goes
    on); between that and the size of the weights plus two checkpoints: a warning."""
    import collections

    from trl_flow.engine import final_save

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(final_save.shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 100, 100))
    tr = make_trainer(max_steps=1)
    tr.training_iteration = lambda step: pytest.fail("computed before the check")
    with pytest.raises(ValueError, match="cannot hold the trained weights.*check_free_space=False"):
        tr.train()
    final, ckpt = final_save.expected_sizes(tr)
    monkeypatch.setattr(final_save.shutil, "disk_usage", lambda p: usage(10**9, 0, final + ckpt))
    with pytest.warns(RuntimeWarning, match="a save may fail for lack of space"):
        make_trainer(max_steps=1, save_steps=1).train()


# ------------------------------------------------------------------------------- a Hub that never answers
@pytest.fixture
def silent_hub():
    """A server on 127.0.0.1 that accepts connections and never answers: its URL."""
    import socket
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held, done = [], threading.Event()

    def accept():
        server.settimeout(0.2)
        while not done.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    done.set()
    thread.join(5)
    for conn in held:
        conn.close()
    server.close()


def _bounded(fn, limit: float):
    """``fn()`` in a daemon thread: its result or exception, or a test failure after ``limit`` s (a hang)."""
    import threading

    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit)
    if thread.is_alive():
        pytest.fail(f"still waiting for the Hub after {limit} s")
    return box


def test_a_silent_hub_fails_the_access_check_at_build_within_the_timeout(silent_hub, tmp_path):
    """HF_ENDPOINT = a server that never answers, `trl-flow grpo --push_to_hub true`: the token check fails after
    TRL_FLOW_HUB_TIMEOUT (1 s) x 2 tries with a one-line error naming the endpoint, before any training (before:
    whoami had no timeout and the command sat there)."""
    env = dict(os.environ, HF_ENDPOINT=silent_hub, HF_TOKEN="hf_test_token", HF_HUB_OFFLINE="0",
               TRL_FLOW_HUB_TIMEOUT="1", TRL_FLOW_HUB_RETRIES="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "trl_flow.cli", "grpo", "--config", "shapes_flow_grpo", "--max_steps", "1",
           "--eval_steps", "0", "--push_to_hub", "true", "--output_dir", str(tmp_path / "out")]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail("trl-flow still waited for the Hub after 90 s")
    said = proc.stdout + proc.stderr
    assert proc.returncode != 0 and time.monotonic() - t0 < 60, said[-2000:]
    assert f"the Hub at {silent_hub} did not answer whoami (the token check) within 1 s (2 tries" in said, said[-2000:]
    assert not (tmp_path / "out" / "log_history.jsonl").exists()  # nothing trained


def test_a_silent_hub_at_the_end_is_an_error_naming_the_weights_and_an_upload_command(silent_hub, make_trainer,
                                                                                      tmp_path, monkeypatch):
    """The Hub stops answering after the build: the push after training fails within the limits instead of
    hanging, naming the saved LoRA and an upload command listing only files that exist (here no card or grid: the
    push failed before writing them; before, the command named them anyway)."""
    import huggingface_hub.constants as constants

    from trl_flow import hub

    out = tmp_path / "out"
    tr = make_trainer(max_steps=1)
    tr.train()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", silent_hub)
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    monkeypatch.setenv("TRL_FLOW_HUB_TIMEOUT", "1")
    monkeypatch.setenv("TRL_FLOW_HUB_RETRIES", "1")
    box = _bounded(lambda: tr.push_to_hub(), 60)
    said = str(box.get("error"))
    assert isinstance(box.get("error"), RuntimeError), box
    assert "did not answer whoami (the token check) within 1 s" in said
    assert f"the trained model is saved in {out} (pytorch_lora_weights.safetensors" in said
    assert "--include pytorch_lora_weights.safetensors" in said
    assert "README.md" not in said and hub.GRID_PATH not in said
    # create_repo hangs too (the token check passed): bounded as well
    monkeypatch.setattr(hub, "_hub_access_error", lambda hint=True: None)
    box = _bounded(lambda: tr.push_to_hub(), 60)
    said = str(box.get("error"))
    assert "did not answer create_repo(out) within 1 s" in said, said
    assert "--include README.md" in said and "pytorch_lora_weights.safetensors" in said


# ------------------------------------------------------------------------------- resume_from_checkpoint
def test_resume_true_on_a_fresh_folder_starts_a_new_run_with_one_line(make_trainer, tmp_path, capsys):
    """The job script that always passes --resume_from_checkpoint True, first run: a new run, said in one line
    (before: 'no complete checkpoint-* folder' and no hint)."""
    tr = make_trainer(max_steps=1)
    tr.train(resume_from_checkpoint=True)
    assert tr.state.global_step == 1
    assert "resume_from_checkpoint=True: no checkpoint in" in capsys.readouterr().out


def test_a_bare_checkpoint_name_is_looked_up_in_output_dir(make_trainer, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    make_trainer(max_steps=1, save_steps=1).train()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    tr = make_trainer(max_steps=2)
    capsys.readouterr()
    tr.train(resume_from_checkpoint="checkpoint-1")
    assert f"Resuming from {out / 'checkpoint-1'} (step 1" in capsys.readouterr().out
    assert [h["step"] for h in tr.state.log_history] == [1, 2]


# ------------------------------------------------------------------------------- prompt files
def test_json_and_csv_prompt_files_load(tmp_path):
    """An existing .json / .csv prompt file loads (before: "Couldn't find any data file")."""
    from trl_flow.data import load_prompts

    (tmp_path / "p.json").write_text(json.dumps([{"prompt": "a cat", "n": 1}, {"prompt": "a dog", "n": 2}]))
    (tmp_path / "p.csv").write_text("prompt,n\na cat,1\na dog,2\n")
    for name in ("p.json", "p.csv"):
        assert list(load_prompts(str(tmp_path / name))["prompt"]) == ["a cat", "a dog"], name
    (tmp_path / "p.yaml").write_text("- a cat\n")
    with pytest.raises(ValueError, match=r"p\.yaml: a prompt file must be \.txt .*\.jsonl .*\.json, \.csv"):
        load_prompts(str(tmp_path / "p.yaml"))


def test_an_integer_beyond_64_bits_in_a_jsonl_file_names_file_line_and_key(tmp_path):
    from trl_flow.data import load_prompts

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a cat", "id": 1}\n{"prompt": "a dog", "id": 18446744073709551616}\n')
    with pytest.raises(ValueError, match=r"p\.jsonl: line 2: key `id` holds 18446744073709551616, a whole number "
                                         r"beyond 64 bits"):
        load_prompts(str(path))


# ------------------------------------------------------------------------------- command line
def test_a_recipe_setting_a_field_twice_is_an_error_naming_both_lines(tmp_path):
    from trl_flow import cli

    recipe = tmp_path / "r.yaml"
    recipe.write_text("trainer: grpo\nlearning_rate: 1.0e-3\nmax_steps: 2\nlearning_rate: 1.0e-4\n")
    with pytest.raises(cli.CLIError, match=r"r\.yaml: line 4: `learning_rate` is set again \(first at line 2\)"):
        cli.parse_args("grpo", ["--config", str(recipe)])


def test_a_negative_number_in_exponent_form_is_a_flag_value(tmp_path):
    """`--learning_rate -1e-4` reaches the field's own check, which names it (before: argparse's "expected one
    argument")."""
    from trl_flow import cli

    with pytest.raises(cli.CLIError, match=r"learning_rate=-0\.0001: must be"):
        cli.parse_args("grpo", ["--config", "shapes_flow_grpo", "--learning_rate", "-1e-4"])
    parser = cli.make_parser("grpo")
    assert cli.attach_negative_numbers(parser, ["--learning_rate", "-1e-4", "--reward_weights", "-1e-4", "2"]) == [
        "--learning_rate=-1e-4", "--reward_weights", "-1e-4", "2"]  # a list flag keeps its values apart


def test_ctrl_c_during_start_up_says_nothing_was_saved(tmp_path, monkeypatch, capsys):
    """A KeyboardInterrupt while the model loads: the message says no checkpoint exists (before: it pointed to
    'the newest complete checkpoint' in the output above, which there was none of)."""
    from trl_flow import cli

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_load_pipeline", interrupted)
    out = tmp_path / "out"
    assert cli.main(["grpo", "--config", "shapes_flow_grpo", "--output_dir", str(out)]) == 130
    said = capsys.readouterr().err
    assert f"interrupted before training began; no checkpoint was saved in {out}" in said, said
    assert "newest complete checkpoint" not in said


def test_sigterm_to_one_worker_saves_and_the_launch_exits_143_with_a_summary(tmp_path):
    """SIGTERM to rank 1 only (an OOM killer's neighbour, a per-process scheduler): both processes finish the
    iteration and save checkpoint-1; `trl-flow --accelerate_config` then exits 143 with one line naming the
    checkpoint (before: exit 1 with the launcher's ChildFailedError traceback and no summary)."""
    (tmp_path / "cluster_rewards.py").write_text(CLUSTER_REWARD)
    markers, out = tmp_path / "markers", tmp_path / "out"
    markers.mkdir()
    env = dict(os.environ, ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               STOP_TEST_DIR=str(markers), STOP_TEST_SLEEP="4", STOP_TEST_ITERATION="1",
               PYTHONPATH=os.pathsep.join([ROOT, str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "trl_flow.cli", "grpo", "--accelerate_config", "multi_gpu", "--num_processes", "2",
           "--main_process_port", str(_free_port()), "--config", "shapes_flow_grpo", "--reward_funcs",
           "cluster_rewards:slow_reward", "--max_steps", "3", "--eval_steps", "0", "--save_steps", "0",
           "--prompts_per_step", "2", "--num_generations", "2", "--per_device_train_batch_size", "4",
           "--gradient_accumulation_steps", "1", "--disable_tqdm", "true", "--output_dir", str(out)]
    proc = _popen(cmd, env, tmp_path, "launcher")
    started = markers / "started-1"
    _wait_until(lambda: started.exists() and started.read_text(), [proc], "iteration 1")
    os.kill(int(started.read_text()), signal.SIGTERM)
    try:
        proc.wait(timeout=HANG)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the launcher did not stop: {_output(proc)[-3000:]}")
    log = _output(proc)
    assert proc.returncode == 143, log[-3000:]
    assert _ckpts(out) == ["checkpoint-1"]
    last = log.strip().splitlines()[-1]
    assert "the processes stopped on SIGTERM (exit status 143); the newest complete checkpoint is" in last, last
    assert "checkpoint-1" in last and "ChildFailedError" not in log


def test_sigterm_says_when_no_preemption_checkpoint_can_be_kept(make_trainer, tmp_path, capsys):
    """finetune="full" keeps no copy of the last completed iteration: a SIGTERM says so at once (before: only
    "finishing this iteration"), and the iteration's end is saved as before."""
    tr = make_trainer(rewards=[_sigterm_copies_in_iteration(3, copies=1)], finetune="full", max_steps=3)
    with pytest.raises(SystemExit):
        tr.train()
    said = capsys.readouterr().out
    assert "SIGTERM: no copy of the last completed iteration is kept for finetune='full'" in said, said
    assert _ckpts(tmp_path / "out") == ["checkpoint-2"]


def test_a_second_signal_lets_the_preemption_checkpoint_being_written_complete(make_trainer, tmp_path, monkeypatch):
    """SIGTERM, then a deliberate second one while the preemption checkpoint is still being written (a slow disk):
    the run stops at once, but only after that write completed, so the last completed iteration is on disk when
    train() returns (before: the stop could end the process mid-write)."""
    from trl_flow.engine import interrupts, preemption

    out = tmp_path / "out"
    real = preemption.write_snapshot

    def slow_write(trainer, snap):
        time.sleep(interrupts.InterruptGuard.COALESCE_S + 2.0)
        return real(trainer, snap)

    monkeypatch.setattr(preemption, "write_snapshot", slow_write)

    def reward(images, prompts, **kw):
        reward.calls += 1
        if reward.calls == 4:  # iteration 3
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(interrupts.InterruptGuard.COALESCE_S + 0.5)
            os.kill(os.getpid(), signal.SIGTERM)  # stop now
        return brightness(images, prompts)

    reward.calls = 0
    tr = make_trainer(rewards=[reward], max_steps=4, save_steps=0)
    with pytest.raises(KeyboardInterrupt) as info:
        tr.train()
    assert f"the newest complete checkpoint is {out / 'checkpoint-2'}" in str(info.value)
    marker = checkpoints.read_marker(str(out / "checkpoint-2"))
    assert marker is not None and tr.state.global_step == 2
    checkpoints.verify_files(marker)
