"""Every trainer on 2 CPU processes (gloo), against the same run on 1 process.

An iteration is a function of (seed, step): the first iteration's trajectories, log-probs, rewards and advantages
are bit-identical on 1 and 2 processes; the update agrees to float rounding when each optimizer step sees the same
samples (1 process: microbatches of 4, accumulation 2; 2 processes: microbatches of 4, no accumulation). The
launch command is the one docs/reliability.md documents: on CPU accelerate needs ACCELERATE_USE_CPU=1, otherwise
each torchrun child runs as an independent single process.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

import multiprocess_worker as mw

TRAINERS = mw.trainer_classes()
HERE = os.path.dirname(os.path.abspath(__file__))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), env.get("PYTHONPATH", "")])
    return env


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    """One torchrun launch (2 processes) training every trainer; returns its output folder."""
    out = tmp_path_factory.mktemp("two")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
           os.path.join(HERE, "multiprocess_worker.py"), str(out), ",".join(c.__name__ for c in TRAINERS)]
    # a deadlock fails here
    proc = subprocess.run(cmd, env=_env(ACCELERATE_USE_CPU="1"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def test_the_registry_holds_every_trainer():
    names = {c.__name__ for c in TRAINERS}
    assert {"FlowGRPOTrainer", "OPGRPOTrainer"} <= names


@pytest.mark.slow
@pytest.mark.parametrize("cls", TRAINERS, ids=lambda c: c.__name__)
def test_two_processes_match_one(two_process_run, tmp_path, cls):
    from safetensors.torch import load_file

    name = cls.__name__
    ranks = [json.loads((two_process_run / f"{name}.rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["num_processes"] for r in ranks] == [2, 2]  # really two processes, not two copies
    assert ranks[0]["buffer_hash"] == ranks[1]["buffer_hash"]  # OP-GRPO: the same buffer on every rank
    two = load_file(str(two_process_run / f"{name}.safetensors"))

    one = mw.make_trainer(cls, str(tmp_path / "one"), gradient_accumulation_steps=2)
    records = mw.record_iterations(one)
    one.train()
    for key in ("states", "log_probs", "rewards", "advantages"):  # iteration 0: bit-identical
        assert torch.equal(records[f"0/{key}"], two[f"0/{key}"]), key
    # The first update (same samples per optimizer step) agrees to float rounding: the gradient is summed in another
    # order (2 processes: DDP all-reduce).
    run_dir = two_process_run / name
    first = {k: load_file(str(d / "checkpoint-1" / "pytorch_lora_weights.safetensors"))
             for k, d in (("one", tmp_path / "one"), ("two", run_dir))}
    update = max(float(v.abs().max()) for k, v in first["one"].items() if "lora_B" in k)  # lora_B starts at 0
    diff = max(float((first["one"][k] - first["two"][k]).abs().max()) for k in first["one"])
    assert update > 2e-4 and diff < 1e-3 * update, (update, diff)

    # Only the main process wrote the log (one line per iteration) and complete checkpoints.
    steps = [json.loads(line)["step"] for line in (run_dir / "log_history.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    assert sorted(os.listdir(run_dir / "checkpoint-2")) == sorted(os.listdir(tmp_path / "one" / "checkpoint-2")
                                                                   + ["random_states_1.pkl"])

    # A checkpoint written by 2 processes resumes on 1: iteration 1 is then bit-identical to the 2-process one,
    # and so is the update to float rounding.
    resumed = mw.make_trainer(cls, str(tmp_path / "resumed"), gradient_accumulation_steps=2)
    records = mw.record_iterations(resumed)
    resumed.train(resume_from_checkpoint=str(run_dir / "checkpoint-1"))
    for key in ("states", "log_probs", "rewards", "advantages"):
        if key == "advantages" and name == "StepwiseFlowGRPOTrainer":
            # Stepwise scores intermediate estimates in eval batches whose composition follows the process count
            # (each process batches its own (sample, step) pairs, one shared r_0 per group); with a trained LoRA
            # a matmul's rounding then differs by batch, and the normalised gains carry it (measured: 3e-5 of 1.7)
            torch.testing.assert_close(records[f"0/{key}"], two[f"1/{key}"], rtol=0, atol=1e-4)
            continue
        assert torch.equal(records[f"0/{key}"], two[f"1/{key}"]), key
    lr = mw.lora(resumed)
    update = max(float(v.abs().max()) for k, v in lr.items() if "lora_B" in k)
    assert max(float((lr[k] - two[f"lora/{k}"]).abs().max()) for k in lr) < 1e-3 * update


def test_a_launcher_world_size_without_processes_is_refused(tmp_path, monkeypatch):
    """torchrun sets WORLD_SIZE=2; without ACCELERATE_USE_CPU=1 (and no GPU) accelerate still runs 1 process per
    child: two independent copies would write into one output_dir. The trainer refuses, naming the fix."""
    import trl_flow

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="ACCELERATE_USE_CPU=1"):
        mw.make_trainer(trl_flow.FlowGRPOTrainer, str(tmp_path / "out"))


def test_batch_arithmetic_error_names_numbers_and_nearest_values():
    from types import SimpleNamespace

    from trl_flow.engine.guards import check_batch

    with pytest.raises(ValueError) as info:
        check_batch(SimpleNamespace(prompts_per_step=3, num_generations=3), 2)
    msg = str(info.value)
    assert "prompts_per_step=3 x num_generations=3 = 9 trajectories" in msg and "over 2 processes" in msg
    assert "prompts_per_step=2 (6 trajectories, 3 per process)" in msg
    assert "prompts_per_step=4 (12 trajectories, 6 per process)" in msg
    assert "num_generations=2 (6 trajectories" in msg and "num_generations=4 (12 trajectories" in msg
    check_batch(SimpleNamespace(prompts_per_step=3, num_generations=4), 2)  # 12 / 2: fine


AFTER_TRAIN = '''
import atexit, os, sys
import torch
sys.path.insert(0, {here!r})
import multiprocess_worker as mw
import trl_flow

torch.set_num_threads(1)
out = {out!r}


def _at_exit():  # registered before the trainer's hook, so it runs after it (atexit runs last-in first-out)
    names = [open(f"/proc/self/task/{{t}}/comm").read() for t in os.listdir("/proc/self/task")]
    with open(os.path.join(out, f"exit{{os.environ['RANK']}}"), "w") as f:
        f.write(f"{{torch.distributed.is_initialized()}} {{sum(n.startswith(('pt_gloo', 'gloo')) for n in names)}}")


atexit.register(_at_exit)
tr = mw.make_trainer(trl_flow.FlowGRPOTrainer, os.path.join(out, "run"), max_steps=1, report_to="tensorboard",
                     run_name="r")
tr.train()
rank = tr.accelerator.process_index
with open(os.path.join(out, f"rank{{rank}}"), "w") as f:
    f.write(str(torch.distributed.is_initialized()))
tr.save_model(os.path.join(out, "after"))  # collective: every process waits for the others
'''  # and no end_training(): the trainer's exit hook destroys the process group


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads by their names in /proc (Linux)")
def test_a_tracked_run_keeps_its_processes_together_after_train(tmp_path):
    """``report_to`` set, two processes: ``train()`` ends its trackers but not the process group, so the Python
    API's next collective call (``save_model``, ``push_to_hub``) works; the script ends without ``end_training()``
    and the trainer's exit hook destroys the group at interpreter exit (left alive, gloo aborts 5-6% of processes
    there: scripts/measure_gloo_exit.py). (Before: ``train()`` called ``end_training()``, which destroyed the group,
    and ``save_model`` failed.)"""
    script = tmp_path / "after_train.py"
    script.write_text(AFTER_TRAIN.format(here=HERE, out=str(tmp_path)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
           str(script)]
    proc = subprocess.run(cmd, env=_env(ACCELERATE_USE_CPU="1"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [open(tmp_path / f"rank{r}").read() for r in (0, 1)] == ["True", "True"]
    assert os.path.exists(tmp_path / "after" / "pytorch_lora_weights.safetensors")
    # destroyed before exit, its gloo threads ended (before: 3 left in each process, kept by the DDP model)
    assert [open(tmp_path / f"exit{r}").read() for r in (0, 1)] == ["False 0", "False 0"]
    assert any(n.startswith("events.out.tfevents") for n in os.listdir(tmp_path / "run" / "r"))  # tracked


#: shared_prefix (tests/test_shared_prefix.py): seed 5 branches iteration 0 at step 2 of 4, and the mixed layout
#: puts samples of both groups on each process, so each process computes the prefix of the groups it holds.
SHARED_PREFIX = dict(same_noise_per_group=True, shared_prefix=True, sde_window_size=1, sde_window_range=3, seed=5)
#: ... and with the other speed fields of Flow-GRPO-Fast's settings (docs/performance.md) on top
FAST = dict(SHARED_PREFIX, sde_window_size=2, sde_window_range=2, batch_replay_steps=True,
            trajectory_storage="trained", offload_rollout_to_cpu=True, cache_prompt_embeds=True)


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [SHARED_PREFIX, FAST], ids=["shared_prefix", "fast"])
def test_shared_prefix_two_processes_match_one(tmp_path, overrides):
    """Flow-GRPO with shared_prefix (alone, and with batched replay, trained-steps storage, CPU offload and cached
    embeddings) on 2 processes against 1: iteration 0's trajectories and rewards agree to float rounding (a prefix
    GEMM's row count is the groups held locally), and so does the first update."""
    from safetensors.torch import load_file

    from trl_flow import FlowGRPOTrainer

    out = tmp_path / "two"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
           os.path.join(HERE, "multiprocess_worker.py"), str(out), "FlowGRPOTrainer", json.dumps(overrides)]
    proc = subprocess.run(cmd, env=_env(ACCELERATE_USE_CPU="1"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    two = load_file(str(out / "FlowGRPOTrainer.safetensors"))
    one = mw.make_trainer(FlowGRPOTrainer, str(tmp_path / "one"), gradient_accumulation_steps=2, **overrides)
    records = mw.record_iterations(one)
    one.train()
    if overrides is SHARED_PREFIX:
        assert one.state.log_history[0]["rows/rollout_transformer"] == (8 * 4 - 2 * 2 * 3)  # s P (G - 1) fewer
    else:  # two trained steps in one update call a microbatch
        assert one.state.log_history[0]["trained_steps"] == 2
        assert one.state.log_history[0]["calls/update_transformer"] == 2  # 2 microbatches, one call each
    for key in ("states", "log_probs", "rewards", "advantages"):
        assert float((records[f"0/{key}"] - two[f"0/{key}"]).abs().max()) <= 1e-5, key
    first = {k: load_file(str(d / "checkpoint-1" / "pytorch_lora_weights.safetensors"))
             for k, d in (("one", tmp_path / "one"), ("two", out / "FlowGRPOTrainer"))}
    update = max(float(v.abs().max()) for k, v in first["one"].items() if "lora_B" in k)
    diff = max(float((first["one"][k] - first["two"][k]).abs().max()) for k in first["one"])
    assert update > 2e-4 and diff < 1e-3 * update, (update, diff)

