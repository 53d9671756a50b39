"""Stopping a run of 2 CPU processes (gloo) keeps what docs/reliability.md promises.

- A SIGTERM to the launcher: torch's elastic agent sends it on to the processes and SIGKILLs them
  ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds later (torch's default: 30). `trl-flow --accelerate_config` sets it to
  ``cli.DEFAULT_SHUTDOWN_TIMEOUT``, so the processes finish the iteration, save it and exit 143; a direct
  `accelerate launch` with the timeout shorter than the iteration loses it (the issue's reproduction, scaled down).
- A process stopped (SIGSTOP) while its peer waits in a collective: two SIGTERMs end the peer at once (its Python
  handler never runs while the collective blocks), and ``ddp_timeout`` ends the wait with an error naming it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from trl_flow import cli
from trl_flow.engine.interrupts import InterruptGuard

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# A 20-minute guard against a hang, never reached when the code works (each run takes well under a minute).
HANG = 1200


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_until(predicate, procs, what: str, limit: float = HANG) -> None:
    """Poll ``predicate``; fail with the processes' output if one exits first or after ``limit`` seconds."""
    end = time.monotonic() + limit
    while not predicate():
        for p in procs:
            if p.poll() is not None:
                pytest.fail(f"a process exited ({p.returncode}) before {what}: {_output(p)[-3000:]}")
        if time.monotonic() > end:
            pytest.fail(f"gave up waiting for {what}")
        time.sleep(0.05)


def _output(proc) -> str:
    proc.log.seek(0)
    return proc.log.read()


def _popen(cmd, env, tmp_path, name):
    log = open(tmp_path / f"{name}.log", "w+")
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, text=True)
    proc.log = log
    return proc


# ------------------------------------------------------------------------------------------- the launcher
SLOW_REWARD = '''
import os, time

calls = 0

def slow_reward(images, prompts, **kwargs):
    """brightness; iteration 1 takes STOP_TEST_SLEEP seconds longer (`started-<rank>` marks its start)."""
    global calls
    calls += 1
    if calls == 2:  # 1: the constructor's check, 2: iteration 1
        rank, where = os.environ["RANK"], os.environ["STOP_TEST_DIR"]
        with open(os.path.join(where, f"started-{rank}"), "w") as f:
            f.write(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", ""))
        time.sleep(float(os.environ["STOP_TEST_SLEEP"]))
        open(os.path.join(where, f"finished-{rank}"), "w").close()
    return images.mean(dim=(1, 2, 3)).tolist()
'''

TRAIN_ARGS = ["grpo", "--config", "shapes_flow_grpo", "--reward_funcs", "slow_rewards:slow_reward",
              "--max_steps", "3", "--eval_steps", "0", "--save_steps", "0", "--prompts_per_step", "2",
              "--num_generations", "2", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1",
              "--disable_tqdm", "true"]


def _launch_and_terminate(tmp_path, launcher: str, sleep: float, **env_extra):
    """Start a 2-process run, SIGTERM the launcher while both processes are in iteration 1 (which takes ``sleep``
    s more), wait for the end. Returns (launcher process, markers folder, output folder)."""
    (tmp_path / "slow_rewards.py").write_text(SLOW_REWARD)
    markers, out = tmp_path / "markers", tmp_path / "out"
    markers.mkdir()
    env = dict(os.environ, ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               STOP_TEST_DIR=str(markers), STOP_TEST_SLEEP=str(sleep),
               PYTHONPATH=os.pathsep.join([ROOT, str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    env.pop("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", None)
    env.update(env_extra)
    port = str(_free_port())
    if launcher == "trl-flow":
        cmd = [sys.executable, "-m", "trl_flow.cli", *TRAIN_ARGS[:1], "--accelerate_config", "multi_gpu",
               "--num_processes", "2", "--main_process_port", port, *TRAIN_ARGS[1:], "--output_dir", str(out)]
    else:  # a direct `accelerate launch`, as docs/reliability.md shows it
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--main_process_port", port, "-m", "trl_flow.cli", *TRAIN_ARGS, "--output_dir", str(out)]
    proc = _popen(cmd, env, tmp_path, "launcher")
    _wait_until(lambda: all((markers / f"started-{r}").exists() for r in (0, 1)), [proc], "iteration 1 started")
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=HANG)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the launcher did not stop: {_output(proc)[-3000:]}")
    return proc, markers, out


@pytest.mark.slow
def test_sigterm_to_trl_flow_launch_finishes_the_iteration_saves_and_exits_143(tmp_path):
    """`trl-flow grpo --accelerate_config multi_gpu --num_processes 2`, SIGTERM to it during iteration 1: both
    processes finish the iteration, checkpoint-1 is written complete, the exit status is 143. The processes were
    given the launcher's shutdown timeout DEFAULT_SHUTDOWN_TIMEOUT (torch's 30 s kills any longer iteration)."""
    from trl_flow.engine import checkpoints

    proc, markers, out = _launch_and_terminate(tmp_path, "trl-flow", sleep=6)
    log = _output(proc)
    assert proc.returncode == 143, log[-3000:]
    assert [(markers / f"started-{r}").read_text() for r in (0, 1)] == [str(cli.DEFAULT_SHUTDOWN_TIMEOUT)] * 2
    assert all((markers / f"finished-{r}").exists() for r in (0, 1))  # the iteration ran to its end
    assert "SIGTERM received: finishing this iteration" in log and "after iteration 1; stopping" in log
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint")) == ["checkpoint-1"]
    checkpoints.verify_files(checkpoints.read_marker(str(out / "checkpoint-1")))
    assert [json.loads(line)["step"] for line in open(out / "log_history.jsonl")] == [1]


@pytest.mark.slow
def test_a_launcher_shutdown_timeout_shorter_than_the_iteration_loses_it(tmp_path):
    """The failure the default prevents, through the knob docs/reliability.md gives for a direct `accelerate
    launch`: with TORCH_ELASTIC_SHUTDOWN_TIMEOUT=2 and a 10 s iteration the launcher SIGKILLs both processes
    mid-iteration: nothing is saved."""
    proc, markers, out = _launch_and_terminate(tmp_path, "accelerate", sleep=10, TORCH_ELASTIC_SHUTDOWN_TIMEOUT="2")
    log = _output(proc)
    assert proc.returncode == 143, log[-3000:]
    assert "forcefully exiting via" in log, log[-3000:]
    assert not any((markers / f"finished-{r}").exists() for r in (0, 1))
    assert not out.exists() or not [n for n in os.listdir(out) if n.startswith("checkpoint")]


def test_trl_flow_launch_keeps_a_shutdown_timeout_the_user_set(monkeypatch):
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "7")
    assert cli.shutdown_timeout_env() == {}
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    from torch.distributed.launcher.api import LaunchConfig

    monkeypatch.setenv(*next(iter(cli.shutdown_timeout_env().items())))
    assert LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2).shutdown_timeout == cli.DEFAULT_SHUTDOWN_TIMEOUT


# ------------------------------------------------------------------------------------ a stopped process
def _start_pair(tmp_path, ddp_timeout: float, *extra: str):
    """Both ranks of multiprocess_stop_worker.py; rank 1 stops itself in iteration 1. Returns (procs, markers)."""
    markers = tmp_path / "markers"
    markers.mkdir()
    port = str(_free_port())
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
                   MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
        cmd = [sys.executable, os.path.join(HERE, "multiprocess_stop_worker.py"), str(tmp_path / "out"), str(markers),
               str(ddp_timeout), *extra]
        procs.append(_popen(cmd, env, tmp_path, f"rank{rank}"))
    _wait_until(lambda: all((markers / f"scored-{r}").exists() for r in (0, 1)), procs, "iteration 1's rewards")
    return procs, markers


def _main_thread_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _blocked(pid: int, polls: int = 20) -> bool:
    """The process's main thread sleeps in each of ``polls`` looks 50 ms apart (waiting in the collective)."""
    for _ in range(polls):
        if _main_thread_state(pid) != "S":
            return False
        time.sleep(0.05)
    return True


def _end(procs):
    for p in procs:
        if p.poll() is None:
            p.kill()  # SIGKILL also ends a stopped process
        p.wait()
        p.log.close()


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc to see the process blocked")
def test_two_sigterms_end_a_process_blocked_in_a_collective_on_a_stopped_peer(tmp_path):
    """Rank 1 is stopped (SIGSTOP) in iteration 1; rank 0 waits for it in the rewards' gather, where no Python
    handler runs. Two SIGTERMs to rank 0 end it at once (exit 143, nothing saved), long before ddp_timeout."""
    procs, _ = _start_pair(tmp_path, ddp_timeout=1100)
    try:
        survivor = procs[0]
        _wait_until(lambda: _blocked(survivor.pid), procs, "rank 0 blocked in the collective")
        survivor.send_signal(signal.SIGTERM)
        time.sleep(InterruptGuard.COALESCE_S + 0.5)  # a second signal, not a copy of the first
        survivor.send_signal(signal.SIGTERM)
        try:
            survivor.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail("rank 0 ignored two SIGTERMs while blocked in a collective")
        log = _output(survivor)
        assert survivor.returncode == 143, log[-3000:]
        assert "SIGTERM received again and the process is blocked outside Python" in log
        assert not (tmp_path / "out").exists() or not [n for n in os.listdir(tmp_path / "out")
                                                         if n.startswith("checkpoint")]
    finally:
        _end(procs)


@pytest.mark.slow
def test_ddp_timeout_ends_the_wait_for_a_stopped_process_with_an_error_naming_it(tmp_path):
    """Rank 1 stopped, rank 0 waiting for it: with ddp_timeout=3 rank 0 fails after 3 s with CollectiveTimeoutError
    naming the option (torch's default would wait 30 min). The process group was made before the trainer
    (`PartialState()` first), so the trainer set the timeout on an existing group."""
    procs, _ = _start_pair(tmp_path, 3, "early")
    try:
        survivor = procs[0]
        try:
            survivor.wait(timeout=300)  # torch's default timeout would be 1800 s
        except subprocess.TimeoutExpired:
            pytest.fail("rank 0 waited past ddp_timeout")
        log = _output(survivor)
        assert survivor.returncode == 1, log[-3000:]
        assert "CollectiveTimeoutError: process 0 of 2: a collective operation" in log, log[-3000:]
        assert "waited 3 s (ddp_timeout=3)" in log and "raise ddp_timeout" in log
    finally:
        _end(procs)
