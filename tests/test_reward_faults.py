"""Rewards that hang and a reward server under load: ``reward_timeout`` turns a hung reward into a
RewardError naming it, before any update or save; a hung reward never keeps the process alive (after the error,
or after two SIGTERMs); the reward server caps the decoded pixels of a request before decoding; the remote reward's
timeout / retries / backoff can be set from the command line."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from conftest import brightness
from trl_flow import FlowGRPOConfig
from trl_flow.rewards import RewardError, compute_rewards
from trl_flow.rewards.threads import DaemonPool
from trl_flow.engine import checkpoints
from trl_flow.engine.interrupts import InterruptGuard

HERE = os.path.dirname(os.path.abspath(__file__))


# ------------------------------------------------------------------------------------------- reward_timeout
def _hanging_reward(release: threading.Event, state: dict):
    """A reward that scores normally until ``state["hang"]`` is set, then waits for ``release`` (forever)."""

    def hangs(images, prompts, **columns):
        if state.get("hang"):
            state["hung"] = state.get("hung", 0) + 1
            release.wait()
        return brightness(images, prompts)

    return hangs


def _lora(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("workers", [0, 1])
def test_a_hung_reward_fails_the_iteration_naming_itself_and_the_timeout(make_trainer, tmp_path, workers):
    release, state = threading.Event(), {}
    tr = make_trainer(rewards=[_hanging_reward(release, state)], reward_timeout=1, reward_num_workers=workers,
                      max_steps=3, save_steps=1)
    saved = {}
    save = tr.save_checkpoint

    def save_and_hang_next():  # checkpoint-1 is written, then iteration 2's reward hangs
        path = save()
        saved.update(_lora(tr))
        state["hang"] = True
        return path

    tr.save_checkpoint = save_and_hang_next
    try:
        with pytest.raises(RewardError, match=r"iteration 2: reward function 'hangs' did not return within "
                                              r"reward_timeout=1 s.*--reward_timeout") as info:
            tr.train()
    finally:
        release.set()  # let the abandoned call end
    assert "checkpoint-1" in str(info.value)  # the error says what is kept
    out = tr.config.output_dir
    complete, incomplete = checkpoints.find_checkpoints(out)
    assert [c.step for c in complete] == [1] and incomplete == []
    checkpoints.verify_files(checkpoints.read_marker(complete[0].path))
    assert state["hung"] >= 1 and tr.state.global_step == 1
    now = _lora(tr)
    assert all(torch.equal(saved[k], now[k]) for k in saved)  # the hung iteration changed no weight


def test_reward_timeout_is_validated(tmp_path):
    for bad in (-1, float("nan"), float("inf"), True, "10"):
        with pytest.raises(ValueError, match="reward_timeout"):
            FlowGRPOConfig(output_dir=str(tmp_path), reward_timeout=bad)
    assert FlowGRPOConfig(output_dir=str(tmp_path), reward_timeout=0).reward_timeout == 0
    assert FlowGRPOConfig(output_dir=str(tmp_path), reward_timeout=None).reward_timeout is None
    assert FlowGRPOConfig(output_dir=str(tmp_path)).reward_timeout == 900


def test_compute_rewards_with_a_timeout_keeps_the_callers_grad_mode_and_the_rewards_own_errors():
    images, prompts = torch.rand(2, 3, 4, 4), ["a", "b"]
    seen = {}

    def probe(images, prompts, **columns):
        seen["grad"], seen["thread"] = torch.is_grad_enabled(), threading.current_thread()
        return [1.0, 2.0]

    with torch.no_grad():
        total, _ = compute_rewards([probe], ["probe"], [1.0], images, prompts, {}, timeout=30)
    assert total.tolist() == [1.0, 2.0] and seen["grad"] is False
    assert seen["thread"] is not threading.current_thread() and seen["thread"].daemon
    compute_rewards([probe], ["probe"], [1.0], images, prompts, {}, timeout=None)
    assert seen["thread"] is threading.current_thread() and seen["grad"] is True  # no limit: called directly

    def own_timeout(images, prompts, **columns):
        raise TimeoutError("socket timed out")

    with pytest.raises(RewardError, match="'own_timeout' raised TimeoutError: socket timed out"):
        compute_rewards([own_timeout], ["own_timeout"], [1.0], images, prompts, {}, timeout=30)


def test_daemon_pool_shutdown_does_not_wait_for_a_hung_call():
    release, started = threading.Event(), threading.Event()
    pool = DaemonPool(1, "test-pool")
    hung = pool.submit(lambda: started.set() or release.wait())
    assert started.wait(60)
    queued = pool.submit(lambda: 1)
    pool.shutdown(grace=0)
    assert queued.cancelled() and not hung.done()  # returned with the call still running
    assert all(t.daemon for t in pool._threads)
    release.set()
    assert hung.result(timeout=60) is True
    with DaemonPool(2) as p:
        assert p.map(lambda x: x * x, range(5)) == [0, 1, 4, 9, 16]
    assert not any(t.is_alive() for t in p._threads)  # idle workers end at shutdown


CHILD = textwrap.dedent("""
    import os, sys, threading
    sys.path.insert(0, {tests!r})
    import torch
    torch.set_num_threads(1)
    from pathlib import Path
    from conftest import PROMPTS, tiny_config
    from trl_flow import FlowGRPOTrainer
    from trl_flow.testing import tiny_sd3_pipeline

    out, workers, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    calls = []

    def hangs(images, prompts, **columns):
        calls.append(1)
        if len(calls) > 1:  # the constructor's check passes; the first iteration hangs
            print("HANGING", flush=True)
            threading.Event().wait()
        return [0.0] * len(prompts)

    config = tiny_config(Path(out), output_dir=out, reward_num_workers=workers, reward_timeout=timeout, max_steps=2)
    FlowGRPOTrainer(config, tiny_sd3_pipeline(), [hangs], train_dataset=list(PROMPTS)).train()
    print("DONE", flush=True)
""")


def _child(tmp_path, workers, timeout):
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(tests=HERE))
    log = open(tmp_path / "child.log", "w")
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "out"), str(workers), str(timeout)],
                            stdout=log, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"))
    return proc, tmp_path / "child.log"


def _wait_for_text(proc, log, text) -> str:
    import time

    while proc.poll() is None:
        content = log.read_text()
        if text in content:
            return content
        time.sleep(0.1)
    raise AssertionError(f"child ended (rc {proc.returncode}) before printing {text!r}:\n{log.read_text()[-3000:]}")


def _ended(proc, log, within: float = 120.0) -> str:
    """The child's output once it has ended; it must end by itself (a hang is killed and fails the test)."""
    try:
        proc.wait(timeout=within)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError("the process did not exit: a hung reward thread keeps it alive\n"
                             + log.read_text()[-3000:])
    return log.read_text()


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_the_process_exits_after_a_reward_timeout(tmp_path, workers):
    proc, log = _child(tmp_path, workers, 1)
    text = _ended(proc, log)
    assert "reward function 'hangs' did not return within reward_timeout=1 s" in text
    assert proc.returncode == 1, text[-3000:]  # the RewardError's exit, not an abort at interpreter shutdown (134)
    assert "terminate called" not in text and "DONE" not in text


@pytest.mark.slow
def test_two_sigterms_end_a_run_whose_reward_hangs_in_a_worker(tmp_path):
    proc, log = _child(tmp_path, 1, 0)  # reward_timeout=0: no limit; the reward hangs in the worker thread
    _wait_for_text(proc, log, "HANGING")
    proc.send_signal(signal.SIGTERM)
    _wait_for_text(proc, log, "SIGTERM received")  # deferred to the end of the iteration, which never comes
    time.sleep(InterruptGuard.COALESCE_S + 0.3)  # a second signal, not a copy of the first
    proc.send_signal(signal.SIGTERM)  # stop now
    text = _ended(proc, log)
    assert "KeyboardInterrupt" in text and "DONE" not in text
    assert "blocked outside Python" not in text  # ended by the KeyboardInterrupt, not by the guard's forced exit
    assert proc.returncode not in (0, -signal.SIGKILL)


# ---------------------------------------------------------------------------------------- the reward server
def _blank_png(side: int) -> str:
    import base64
    import io

    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.zeros((side, side, 3), np.uint8)).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


@pytest.fixture
def decoded(monkeypatch):
    """Records every image whose pixels the wire format decodes (the headers alone are not recorded)."""
    from trl_flow.rewards import wire

    seen = []
    pixels = wire._pixels

    def recording(im, where):
        seen.append((where, im.size))
        return pixels(im, where)

    monkeypatch.setattr(wire, "_pixels", recording)
    return seen


def test_the_server_refuses_a_request_over_its_pixel_budget_before_decoding(decoded):
    """Issue 36: four blank 4096x4096 PNGs (a 261 KB request, far under the 64 MiB body cap) took the server from
    256 MB to 2.3 GB. Over the per-request pixel budget now, it answers 413 naming the limit and the flag, and
    decodes nothing."""
    pytest.importorskip("uvicorn")
    from test_rewards_remote import serve_app

    from trl_flow.rewards import RemoteReward, RemoteRewardError
    from trl_flow.rewards.server import build_app
    from trl_flow.rewards.wire import MAX_REQUEST_PIXELS

    big = _blank_png(4096)
    with serve_app(build_app(brightness)) as url:  # the defaults
        code, body = RemoteReward(url).transport.request(
            url + "/score", {"schema_version": 1, "images": [big] * 4, "prompts": ["x"] * 4})
        assert code == 413, body
        assert (f"67108864 pixels in all, over the limit of {MAX_REQUEST_PIXELS} pixels per request" in body.decode()
                and "--max-request-pixels" in body.decode())
        assert decoded == []  # refused on the PNG headers: not one pixel decoded
    with serve_app(build_app(brightness, max_request_pixels=2 * 32 * 32)) as url:
        client = RemoteReward(url, batch_size=3, max_retries=0)
        with pytest.raises(RemoteRewardError, match=r"HTTP 413: request of 3 images has 3072 pixels in all, over the "
                                                    r"limit of 2048 pixels per request.*--max-request-pixels"):
            client(torch.rand(3, 3, 32, 32), ["a", "b", "c"])
        assert decoded == []
        assert len(client(torch.rand(2, 3, 32, 32), ["a", "b"])) == 2  # at the limit: served
        assert [size for _, size in decoded] == [(32, 32), (32, 32)]


def test_the_pixel_budget_counts_every_video_frame(decoded):
    from trl_flow.rewards.wire import TooManyPixels, decode_images, encode_images

    video = encode_images(torch.rand(2, 3, 3, 8, 8))  # 2 samples x 3 frames of 8x8 = 384 pixels
    with pytest.raises(TooManyPixels, match="request of 2 videos has 384 pixels in all, over the limit of 383"):
        decode_images(video, max_total_pixels=383)
    assert decoded == []
    assert decode_images(video, max_total_pixels=384).shape == (2, 3, 3, 8, 8)


def test_the_server_command_passes_max_request_pixels(monkeypatch):
    pytest.importorskip("uvicorn")
    import uvicorn

    from trl_flow.rewards import server

    built = {}
    real = server.build_app
    monkeypatch.setattr(server, "build_app", lambda *a, **kw: built.update(kw) or real(*a, **kw))
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: built.update(app=app))
    server.main(["--reward", "jpeg_compressibility", "--max-request-pixels", "12345"])
    assert built["max_request_pixels"] == 12345 and built["app"] is not None
    with pytest.raises(SystemExit, match="--max-request-pixels 0: must be an integer >= 1"):
        server.main(["--reward", "jpeg_compressibility", "--max-request-pixels", "0"])
    with pytest.raises(ValueError, match="max_request_pixels=0"):
        real(brightness, max_request_pixels=0)


# ------------------------------------------------------------------------------- the remote reward's options
def test_reward_urls_carry_the_clients_timeout_retries_and_backoff():
    from trl_flow import cli

    reward = cli.resolve_reward("http://127.0.0.1:8001?timeout=30&max_retries=5&backoff=2.5&batch_size=8&name=geneval")
    t = reward.transport
    assert (t.timeout, t.max_retries, t.backoff) == (30.0, 5, 2.5)
    assert reward.urls == ["http://127.0.0.1:8001"] and reward.batch_size == 8 and reward.__name__ == "geneval"
    plain = cli.resolve_reward("http://127.0.0.1:8001")
    assert (plain.transport.timeout, plain.transport.max_retries, plain.transport.backoff) == (120.0, 3, 1.0)
    for spec, message in [
        ("http://h:1?timeout=abc", "timeout='abc' must be a positive number of seconds"),
        ("http://h:1?timeout=0", "timeout='0' must be a positive number of seconds"),
        ("http://h:1?max_retries=-1", "max_retries='-1' must be an integer >= 0"),
        ("http://h:1?max_retries=2.5", "max_retries='2.5' must be an integer >= 0"),
        ("http://h:1?backoff=inf", "backoff='inf' must be a number of seconds >= 0"),
        ("http://h:1?retries=3", "unknown option 'retries'; the options are timeout, max_retries, backoff"),
        ("http://h:1?timeout", "must be key=value pairs"),
        ("http://h:1?timeout=1&timeout=2", "option 'timeout' is given twice"),
    ]:
        with pytest.raises(cli.CLIError, match=r"--reward_funcs: reward URL .*" + re.escape(message)):
            cli.resolve_reward(spec)


def test_the_urls_retries_and_backoff_are_used():
    from test_rewards_remote import serve_handler

    from trl_flow.rewards import RemoteReward, RemoteRewardError

    with serve_handler(lambda path, body, headers: (503, b'{"detail": "warming up"}')) as (url, seen):
        reward = RemoteReward.from_url(url + "?max_retries=2&backoff=0&timeout=30")
        with pytest.raises(RemoteRewardError, match="no answer after 3 attempt"):
            reward(torch.rand(1, 3, 8, 8), ["x"])
        assert len(seen) == 3  # 1 + max_retries
