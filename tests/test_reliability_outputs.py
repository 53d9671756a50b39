"""What a run leaves on disk when things go wrong at the end or around it: a Hub outage after training,
resuming an older checkpoint, an evaluation failure at a save step, SIGTERM / a second Ctrl-C / a full disk during
the final save or a checkpoint, overwrite_output_dir's deletions, and two runs in one output_dir."""

from __future__ import annotations

import errno
import http.server
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from conftest import brightness

from trl_flow import storage
from trl_flow.engine import checkpoints
from trl_flow.engine.interrupts import InterruptGuard

HERE = os.path.dirname(os.path.abspath(__file__))


def _ckpts(out) -> list[str]:
    return sorted(n for n in os.listdir(out) if n.startswith("checkpoint-"))


def _lora(trainer) -> dict:
    from peft.utils import get_peft_model_state_dict

    model = trainer.accelerator.unwrap_model(trainer.model)
    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


def _same_lora(folder, trainer) -> bool:
    from safetensors.torch import load_file

    saved = load_file(os.path.join(folder, storage.LORA_WEIGHT_NAME))
    trained = _lora(trainer)
    saved = {k.removeprefix("transformer."): v for k, v in saved.items()}
    return saved.keys() == trained.keys() and all(torch.equal(saved[k], trained[k]) for k in trained)


# --------------------------------------------------------------------------------------- item 2: Hub outage
class _FakeHub(http.server.BaseHTTPRequestHandler):
    """The Hub on 127.0.0.1: ``whoami`` answers while ``server.whoami_up``; every other request (create_repo,
    upload) gets a 503, as during an outage."""

    def _answer(self):
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        self.server.requests.append((self.command, self.path.split("?")[0]))
        up = self.path.startswith("/api/whoami") and self.server.whoami_up
        body = json.dumps({"name": "me", "type": "user", "auth": {"accessToken": {"role": "write"}}} if up
                          else {"error": "Service Unavailable"}).encode()
        self.send_response(200 if up else 503)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = do_HEAD = _answer

    def log_message(self, *args):
        pass


@pytest.fixture
def flaky_hub(monkeypatch):
    import huggingface_hub.constants as constants

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeHub)
    server.requests, server.whoami_up = [], True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    yield server
    server.shutdown()
    server.server_close()


def test_a_hub_outage_at_the_end_keeps_the_model_and_says_how_to_push_it(flaky_hub, make_trainer, tmp_path):
    from huggingface_hub.utils import filter_repo_objects

    out = tmp_path / "out"
    tr = make_trainer(max_steps=1, push_to_hub=True, hub_model_id="me/tiny", hub_base_model="org/base",
                      hub_license="apache-2.0")  # save_steps=0: no checkpoint at all
    assert flaky_hub.requests == [("GET", "/api/whoami-v2")]  # the Hub answered at the start
    with pytest.raises(RuntimeError) as info:
        tr.train()  # ... and fails at the end: creating the repository gets a 503
    said = str(info.value)
    assert "push_to_hub: the upload to me/tiny failed" in said and "503" in said
    assert f"the trained model is saved in {out}" in said and "push_to_hub=False" not in said
    assert _same_lora(out, tr)  # the weights are on disk, exactly the trained ones
    assert (out / "README.md").is_file() and (out / "images" / "before_after.png").is_file()
    command = re.search(r"Push it later with: (hf upload .*?) -- or in Python", said).group(1)
    assert command.startswith(f"hf upload me/tiny {out} .")
    files = [str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()]
    patterns = re.findall(r"--include (\S+)", command)
    assert set(filter_repo_objects(files, allow_patterns=patterns)) == {
        "pytorch_lora_weights.safetensors", "README.md", "images/before_after.png"}

    # A push retried while the Hub is fully down fails at its access check, and writes the model only once.
    flaky_hub.whoami_up = False
    mtime = os.stat(out / storage.LORA_WEIGHT_NAME).st_mtime_ns
    with pytest.raises(RuntimeError, match=r"the Hub at http://127\.0\.0\.1:\d+ cannot be used.*Push it later with"):
        tr.push_to_hub()
    assert os.stat(out / storage.LORA_WEIGHT_NAME).st_mtime_ns == mtime


# --------------------------------------------------------------------- item 3: resuming an older checkpoint
def _lr(folder) -> float:
    return json.loads((folder / checkpoints.CONFIG_NAME).read_text())["learning_rate"]


def _check_branch_moved_aside(out, said: str):
    abandoned = [p for p in out.iterdir() if p.name.startswith(checkpoints.ABANDONED_PREFIX)]
    assert len(abandoned) == 1 and abandoned[0].name.startswith("abandoned-after-step-1-")
    assert sorted(os.listdir(abandoned[0])) == ["checkpoint-2", "checkpoint-3"]
    assert _lr(abandoned[0] / "checkpoint-2") == 1e-3  # the abandoned branch, untouched
    assert "moved to" in said and "checkpoint-2, checkpoint-3" in said
    assert _ckpts(out) == ["checkpoint-1", "checkpoint-2"]
    assert _lr(out / "checkpoint-2") == 5e-4  # the resumed run's own checkpoint


def test_resuming_an_older_checkpoint_moves_the_abandoned_branch_aside(make_trainer, tmp_path, capsys):
    out = tmp_path / "out"
    make_trainer(max_steps=3, save_steps=1).train()
    capsys.readouterr()
    resumed = make_trainer(max_steps=2, save_steps=1, learning_rate=5e-4)
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-1"))
    _check_branch_moved_aside(out, capsys.readouterr().out)
    assert [json.loads(line)["step"] for line in open(out / "log_history.jsonl")] == [1, 2]
    assert _same_lora(out, resumed)  # the final model is the new branch's
    # resume_from_checkpoint=True continues the new branch, not the abandoned one
    again = make_trainer(max_steps=3, save_steps=1, learning_rate=5e-4)
    again.train(resume_from_checkpoint=True)
    assert f"Resuming from {out / 'checkpoint-2'} (step 2" in capsys.readouterr().out
    assert _ckpts(out) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"] and _lr(out / "checkpoint-3") == 5e-4


def test_resuming_an_older_checkpoint_from_the_command_line(tmp_path, monkeypatch, capsys, fresh_pipe):
    from trl_flow import cli

    out = tmp_path / "run"
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\na dog\n")
    monkeypatch.setattr(cli, "_load_pipeline", lambda *a: fresh_pipe())
    common = ["grpo", "--output_dir", str(out), "--dataset_name", str(prompts), "--reward_funcs",
              "jpeg_incompressibility", "--height", "32", "--width", "32", "--max_sequence_length", "16",
              "--num_inference_steps", "2", "--num_generations", "2", "--prompts_per_step", "2",
              "--per_device_train_batch_size", "4", "--save_steps", "1", "--disable_tqdm", "true"]
    assert cli.main(common + ["--max_steps", "3", "--learning_rate", "1e-3"]) == 0
    assert _ckpts(out) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    capsys.readouterr()
    assert cli.main(common + ["--max_steps", "2", "--learning_rate", "5e-4",
                              "--resume_from_checkpoint", str(out / "checkpoint-1")]) == 0
    _check_branch_moved_aside(out, capsys.readouterr().out)


# ------------------------------------------------------------------- item 4: evaluation failure at a save step
def test_an_evaluation_failure_at_a_save_step_keeps_that_checkpoint(make_trainer, tmp_path):
    from trl_flow.rewards import RewardError

    out = tmp_path / "out"
    eval_calls = []

    def reward(images, prompts, **kw):
        if "an eval prompt" in prompts:
            eval_calls.append(len(eval_calls))
            if len(eval_calls) == 2:  # 1: before the first iteration; 2: after iteration 2, a save step
                raise ConnectionError("judge unreachable")
        return brightness(images, prompts)

    tr = make_trainer(rewards=[reward], max_steps=3, save_steps=2, eval_steps=2, eval_dataset=["an eval prompt"])
    with pytest.raises(RewardError, match="evaluation at iteration 2: .*judge unreachable.*checkpoint-2"):
        tr.train()
    assert _ckpts(out) == ["checkpoint-2"]
    checkpoints.verify_files(checkpoints.read_marker(str(out / "checkpoint-2")))
    # Resumed, the run evaluates step 2 first (the checkpoint was saved before that evaluation), then goes on.
    resumed = make_trainer(max_steps=3, eval_steps=2, eval_dataset=["an eval prompt"])
    resumed.train(resume_from_checkpoint=True)
    evals = [h["step"] for h in resumed.state.log_history if "eval/reward" in h]
    assert evals == [0, 2, 3]


# --------------------------------------------------------------------------- item 5: the final save is safe
def _signal_in_save(pipe, *sigs, partial: bool = False):
    """Make ``pipe.save_pretrained`` send ``sigs`` to this process (after writing part of the pipeline if
    ``partial``), then finish writing."""
    real = pipe.save_pretrained

    def save_pretrained(folder, **kw):
        if partial:
            pipe.vae.save_pretrained(os.path.join(folder, "vae"))
        for i, sig in enumerate(sigs):
            if i:  # a second signal, not a copy of the first
                time.sleep(InterruptGuard.COALESCE_S + 0.3)
            os.kill(os.getpid(), sig)
        return real(folder, **kw)

    pipe.save_pretrained = save_pretrained


def test_sigterm_during_the_final_save_lets_it_finish_then_exits_143(make_trainer, tmp_path):
    from trl_flow.models import load_pipeline

    out = tmp_path / "out"
    tr = make_trainer(finetune="full", beta=0.0, max_steps=1)
    _signal_in_save(tr.pipe, signal.SIGTERM)
    with pytest.raises(SystemExit) as info:
        tr.train()
    assert info.value.code == 128 + signal.SIGTERM
    assert (out / "model_index.json").is_file() and not (out / storage.SAVE_TMP_NAME).exists()
    reloaded = load_pipeline(str(out)).transformer.state_dict()
    trained = tr.accelerator.unwrap_model(tr.model).state_dict()
    assert reloaded.keys() == trained.keys() and all(torch.equal(reloaded[k], trained[k]) for k in trained)


def test_a_second_ctrl_c_during_the_final_save_leaves_no_partial_folder_and_says_so(make_trainer, tmp_path):
    out = tmp_path / "out"
    tr = make_trainer(finetune="full", beta=0.0, max_steps=1)
    _signal_in_save(tr.pipe, signal.SIGINT, signal.SIGINT, partial=True)
    with pytest.raises(KeyboardInterrupt) as info:
        tr.train()
    said = str(info.value)
    assert "interrupted while saving the final model: nothing of it was kept" in said
    assert "no checkpoint was saved" in said and "newest complete checkpoint" not in said
    assert sorted(os.listdir(out)) == [".trl_flow.lock", "log_history.jsonl"]  # no vae/, no model_index.json


def _disk_full_in(monkeypatch, module, name):
    """``module.name`` writes a few bytes to its target, then fails like a full disk."""
    calls = []

    def full(obj, path, *a, **k):
        calls.append(path)
        with open(path, "wb") as f:
            f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(module, name, full)
    return calls


def test_disk_full_during_the_final_save_keeps_the_weights_for_a_retry(make_trainer, tmp_path, monkeypatch):
    import safetensors.torch

    out = tmp_path / "out"
    tr = make_trainer(max_steps=1)
    with monkeypatch.context() as m:
        calls = _disk_full_in(m, safetensors.torch, "save_file")
        with pytest.raises(storage.SaveError) as info:
            tr.train()
        assert calls
        said = str(info.value)
        assert f"writing the model into {out} failed: the disk mounted at " in said and "is full" in said
        assert "nothing of this save was kept" in said and "call trainer.save_model()" in said
        assert "no checkpoint was saved" in said
        assert not (out / storage.LORA_WEIGHT_NAME).exists() and not (out / storage.SAVE_TMP_NAME).exists()
        # A folder that already holds a model keeps it, byte for byte.
        other = tmp_path / "other"
        other.mkdir()
        (other / storage.LORA_WEIGHT_NAME).write_bytes(b"an older model")
        with pytest.raises(storage.SaveError):
            tr.save_model(str(other))
        assert (other / storage.LORA_WEIGHT_NAME).read_bytes() == b"an older model"
        assert os.listdir(other) == [storage.LORA_WEIGHT_NAME]
    assert tr.save_model() == str(out)  # space again: the weights were kept in memory
    assert _same_lora(out, tr)


def test_disk_full_mid_checkpoint_names_the_disk_and_keeps_the_previous_checkpoint(make_trainer, tmp_path,
                                                                                  monkeypatch):
    import accelerate.checkpointing

    out = tmp_path / "out"
    tr = make_trainer(max_steps=2, save_steps=1)
    real_save = accelerate.checkpointing.save

    def save(obj, path, *a, **k):
        if "checkpoint-2" in str(path):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4160 vs 4048")
        return real_save(obj, path, *a, **k)

    monkeypatch.setattr(accelerate.checkpointing, "save", save)
    with pytest.raises(storage.SaveError) as info:
        tr.train()
    said = str(info.value)
    assert said.startswith(f"checkpoint-2: writing it into {out} failed: the disk mounted at ")
    assert "is full" in said and f"the previous checkpoint, {out / 'checkpoint-1'}, is intact" in said
    assert _ckpts(out) == ["checkpoint-1"]  # no checkpoint-2.tmp left taking space
    checkpoints.verify_files(checkpoints.read_marker(str(out / "checkpoint-1")))


# -------------------------------------------------------------------- item 6: overwrite_output_dir deletes
def test_overwrite_deletes_only_what_this_library_wrote_inside_output_dir(make_trainer, tmp_path):
    from trl_flow import FlowGRPOConfig

    out, victim, linked = tmp_path / "out", tmp_path / "victim", tmp_path / "linked"
    for folder in (victim, linked, out / "transformer", out / "tb" / "1712.5", out / "mine"):
        folder.mkdir(parents=True)
    (victim / "data.txt").write_text("keep")
    (linked / "data.txt").write_text("keep")
    (out / "vae").symlink_to(linked, target_is_directory=True)
    (out / "model_index.json").write_text(json.dumps({
        "_class_name": "StableDiffusion3Pipeline", "transformer": ["diffusers", "SD3Transformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"], "../victim": ["diffusers", "X"], str(victim): ["diffusers", "X"]}))
    (out / "transformer" / "config.json").write_text("{}")
    (out / "log_history.jsonl").write_text('{"step": 1}\n')
    (out / "notes.txt").write_text("the user's")
    (out / "tb" / "events.out.tfevents.1712.host.1.0").write_bytes(b"old run")  # an earlier tensorboard run
    (out / "tb" / "1712.5" / "hparams.yml").write_text("a: 1\n")
    (out / "tb" / "1712.5" / "events.out.tfevents.1712.host.1.1").write_bytes(b"old run")
    (out / "mine" / "events.out.tfevents.1").write_bytes(b"x")  # not only event files: the user's folder
    (out / "mine" / "plot.png").write_bytes(b"x")

    tr = make_trainer(max_steps=1, overwrite_output_dir=True, report_to="tensorboard", run_name="tb")
    tr.train()
    assert (victim / "data.txt").read_text() == "keep" and (linked / "data.txt").read_text() == "keep"
    assert not (out / "vae").exists() and not (out / "transformer").exists()  # the link is removed, not followed
    assert (out / "notes.txt").read_text() == "the user's" and sorted(os.listdir(out / "mine")) == [
        "events.out.tfevents.1", "plot.png"]
    tb_files = {p.name for p in (out / "tb").rglob("*") if p.is_file()}
    assert tb_files and "events.out.tfevents.1712.host.1.0" not in tb_files  # only the new run's events
    assert "hparams.yml" not in {p.name for p in (out / "tb").rglob("*") if "1712.5" in str(p)}
    help_text = FlowGRPOConfig.__dataclass_fields__["overwrite_output_dir"].metadata["help"]
    assert "first deletes them" in help_text and "checkpoint-* folders" in help_text  # no longer "they are kept"


# ------------------------------------------------------------------ two runs in one output_dir: the lock
@pytest.mark.slow
def test_a_second_run_in_the_same_output_dir_is_refused_until_the_first_ends_even_by_sigkill(tmp_path):
    import multiprocess_worker as mw

    import trl_flow

    out = tmp_path / "out"
    child = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "checkpoints_child.py"), str(out), "3", "0", "1.0"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
                 PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])))
    try:
        assert any(line.startswith("SAVE 1") for line in child.stdout), "the first run did not start"
        second = mw.make_trainer(trl_flow.OPGRPOTrainer, str(out), max_steps=3)
        with pytest.raises(RuntimeError, match=rf"is in use by another trl_flow run \(process {child.pid} on "):
            second.train(resume_from_checkpoint=True)
        log_before = (out / "log_history.jsonl").read_text()
    finally:
        child.kill()  # SIGKILL: no clean-up runs, the lock file stays
        child.communicate(timeout=120)
    assert (out / ".trl_flow.lock").exists() and log_before
    second.train(resume_from_checkpoint=True)  # the kernel released the dead run's lock
    assert second.state.global_step == 3
    assert [json.loads(line)["step"] for line in open(out / "log_history.jsonl")] == [1, 2, 3]
