"""FSDP2 for real on 2 CPU processes (gloo), against the same runs under DDP and on 1 process.

The launches use the environment the shipped ``fsdp2`` config gives (accelerate's own launch code computes it) with
the CPU forced, as ``ACCELERATE_USE_CPU=true trl-flow ... --accelerate_config fsdp2 --num_processes 2`` does. Each
run trains 2 iterations of the tiny SD3 pipeline with the KL reference forward (``beta > 0``: adapters disabled,
or the frozen copy), EMA and active gradient clipping, saves a checkpoint per iteration and calls ``save_model``.

Tolerances. Iteration 0's trajectories, log-probs, rewards and advantages are bit-identical on any process count
(tests/test_multiprocess.py). The first update agrees to float rounding when each optimizer step sees the same
samples (1 process: microbatches of 4, accumulation 2; 2 processes: microbatches of 4): the gradient is summed in
another order (DDP all-reduce, FSDP reduce-scatter), and Adam divides by sqrt(v), so an entry whose gradient is
tiny turns that rounding into a visible update difference. Measured max difference / max update (first update):
LoRA 2e-7 to 1.2e-6 (DDP and FSDP vs 1 process; FSDP vs DDP 0), full fine-tuning 1.5e-5; after the second
iteration, sampled from weights that already differ by rounding, FSDP vs DDP: LoRA 0, full 2.5e-4 to 4.4e-4. The
bounds (LoRA 1e-3, full 5e-3 of the update) are far below what a real bug gives (a missing reduction, a per-shard
clip norm or a wrong shard: differences of the order of the update itself). The logged (pre-clip) gradient norm
is compared to 1e-5 relative: a norm taken over one process's shard would be ~30% off.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

import fsdp_worker as fw
import multiprocess_worker as mw

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
#: Every trainer that FSDP can run (OP-GRPO is refused: tested below), LoRA and full fine-tuning.
RUNS = [f"{c}:{ft}" for c in ("FlowGRPOTrainer", "StepwiseFlowGRPOTrainer", "FlowDPPOTrainer") for ft in ("lora",
    "full")]
TOL = {"lora": 1e-3, "full": 5e-3}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fsdp2_env() -> dict[str, str]:
    """The FSDP variables `accelerate launch --config_file fsdp2.yaml` gives its processes."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    from trl_flow import cli

    args = launch_command_parser().parse_args(
        ["--config_file", cli.shipped("accelerate_configs")["fsdp2"], "--num_processes", "2", "x.py"])
    args, _, _ = _validate_launch_command(args)
    env = {k: v for k, v in prepare_multi_gpu_env(args).items() if k.startswith("FSDP_") or k == "ACCELERATE_USE_FSDP"}
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_VERSION"] == "2"
    return env


def _launch(out, specs, nproc=2, fsdp=True):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", ACCELERATE_USE_CPU="1",
               **(fsdp2_env() if fsdp else {}))
    env["PYTHONPATH"] = os.pathsep.join([ROOT, HERE, env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(_free_port()), os.path.join(HERE, "fsdp_worker.py"), str(out), ",".join(specs)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)  # a deadlock fails here
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    """One 2-process FSDP2 launch: every run, then resumes of FlowGRPO from its checkpoint-1, then OP-GRPO."""
    out = tmp_path_factory.mktemp("fsdp")
    resumes = [f"resume:FlowGRPOTrainer:{ft}:{out}/FlowGRPOTrainer-{ft}/checkpoint-1" for ft in ("lora", "full")]
    return _launch(out, RUNS + resumes + ["refuse:OPGRPOTrainer"])


@pytest.fixture(scope="module")
def fsdp_one(fsdp, tmp_path_factory):
    """One 1-process FSDP2 launch (torchrun --nproc_per_node 1, same environment) resuming both 2-process
    checkpoints."""
    specs = [f"resume:FlowGRPOTrainer:{ft}:{fsdp}/FlowGRPOTrainer-{ft}/checkpoint-1" for ft in ("lora", "full")]
    return _launch(tmp_path_factory.mktemp("fsdp_one"), specs, nproc=1)


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("ddp"), RUNS, fsdp=False)


def _load(folder, name):
    from safetensors.torch import load_file

    return load_file(str(folder / f"{name}.safetensors")), json.loads((folder / f"{name}.json").read_text())


def _max_diff(a: dict, b: dict, keys) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in keys)


@pytest.mark.slow
@pytest.mark.parametrize("spec", RUNS)
def test_fsdp2_shards_and_matches_ddp_and_one_process(fsdp, ddp, tmp_path, spec):
    import trl_flow

    cls_name, finetune = spec.split(":")
    name = f"{cls_name}-{finetune}"
    two, info = _load(fsdp, name)
    assert info["distributed"] == {"distributed_type": "FSDP", "num_processes": 2, "fsdp_version": 2,
                                   "fsdp_state_dict_type": "FULL_STATE_DICT", "fsdp_on_cpu": True}
    saved_state = json.loads((fsdp / name / "checkpoint-2" / "trainer_state.json").read_text())
    assert saved_state["distributed"] == info["distributed"]
    # Really sharded: each process holds about half of every parameter (of the trained model and, full
    # fine-tuning with beta > 0, of the frozen reference copy too); the halves add up to the whole.
    ranks = [json.loads((fsdp / f"{name}.rank{r}.json").read_text()) for r in (0, 1)]
    for module in ("model", "ref_model"):
        if module == "ref_model" and finetune == "lora":
            assert ranks[0][module] is None  # the reference is the model with adapters disabled
            continue
        (l0, full), (l1, full1) = ranks[0][module], ranks[1][module]
        assert full == full1 and l0 + l1 == full and 0.4 < l0 / full < 0.6, ranks

    one = fw.make(getattr(trl_flow, cls_name), str(tmp_path / "one"), finetune, gradient_accumulation_steps=2)
    w0 = fw.trained_weights(one)
    ones = fw.record(one)
    one.train()
    for key in ("states", "log_probs", "rewards", "advantages"):  # iteration 0: bit-identical
        assert torch.equal(ones[f"0/{key}"], two[f"0/{key}"]), key
    ddp_two, ddp_info = _load(ddp, name)
    assert ddp_info["distributed"] == {"distributed_type": "MULTI_CPU", "num_processes": 2}
    # The first update: FSDP and DDP agree with 1 process and with each other to float rounding.
    first = [f"0/w/{k}" for k in w0]
    update = max(float((ones[f"0/w/{k}"] - w0[k]).abs().max()) for k in w0)
    assert update > 1e-4
    for other in (two, ddp_two):
        assert _max_diff(ones, other, first) < TOL[finetune] * update, (_max_diff(ones, other, first), update)
    # After the second iteration (sampled from slightly different weights, so its rollout differs by rounding
    # too): FSDP and DDP, both on 2 processes, still agree to the same bound.
    final = [f"w/{k}" for k in w0]
    print(f"\n{spec}: first update {update:.3g}; max diff / update: FSDP-1proc "
          f"{_max_diff(ones, two, first) / update:.3g}, DDP-1proc {_max_diff(ones, ddp_two, first) / update:.3g}, "
          f"FSDP-DDP {_max_diff(two, ddp_two, first) / update:.3g}; final FSDP-DDP "
          f"{_max_diff(two, ddp_two, final) / update:.3g}")
    assert _max_diff(two, ddp_two, final) < TOL[finetune] * update, (_max_diff(two, ddp_two, final), update)
    # Gradient clipping (max_grad_norm=1e-4, below every gradient norm here: always active) sees the global norm.
    # First iteration to 1e-5 (rounding), the second to 1e-3 (its rollout differs by rounding too); a norm over one
    # process's shard would be ~30% off.
    norms = [h["grad_norm"] for h in one.state.log_history]
    for got in (info["grad_norm"], ddp_info["grad_norm"]):
        assert got[0] == pytest.approx(norms[0], rel=1e-5) and got[1] == pytest.approx(norms[1], rel=1e-3)

    # save_model from sharded parameters: the same diffusers-loadable files as under DDP (the EMA weights).
    from trl_flow.testing import tiny_sd3_pipeline

    if finetune == "lora":
        from safetensors.torch import load_file

        saved = {d: load_file(str(f / name / "model" / "pytorch_lora_weights.safetensors")) for d, f in
                 (("fsdp", fsdp), ("ddp", ddp))}
        assert saved["fsdp"].keys() == saved["ddp"].keys()
        assert _max_diff(saved["fsdp"], saved["ddp"], saved["fsdp"]) < TOL[finetune] * update
        pipe = tiny_sd3_pipeline()
        pipe.load_lora_weights(str(fsdp / name / "model"))
        assert "default_0" in pipe.transformer.peft_config
    else:
        from diffusers import StableDiffusion3Pipeline

        loaded = {d: StableDiffusion3Pipeline.from_pretrained(
            str(f / name / "model"), text_encoder_3=None, tokenizer_3=None).transformer.state_dict()
                  for d, f in (("fsdp", fsdp), ("ddp", ddp))}
        assert loaded["fsdp"].keys() == loaded["ddp"].keys()
        assert _max_diff(loaded["fsdp"], loaded["ddp"], loaded["fsdp"]) < TOL[finetune] * update
        ema_vs_raw = max(float((loaded["fsdp"][k] - two[f"w/{k}"]).abs().max()) for k in w0)
        # The EMA weights, not the raw ones (EMAModel's decay is min(0.5, (1 + n) / (10 + n)) here: measured 9% of
        # the update apart, 20x the agreement bound above)
        assert ema_vs_raw > 0.02 * update


@pytest.mark.slow
@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_fsdp2_checkpoint_resumes_bit_identically_on_two_and_to_rounding_on_one(fsdp, fsdp_one, finetune):
    name = f"FlowGRPOTrainer-{finetune}"
    full_run, _ = _load(fsdp, name)
    files = sorted(os.listdir(fsdp / name / "checkpoint-1"))
    assert "pytorch_model_fsdp.bin" in files and "ema.safetensors" in files
    assert ("pytorch_lora_weights.safetensors" in files) == (finetune == "lora")

    def same_iteration(resumed, exact):  # the resumed run's first iteration is the uninterrupted run's second
        for key in ("states", "log_probs", "rewards", "advantages"):
            a, b = resumed[f"0/{key}"], full_run[f"1/{key}"]
            assert torch.equal(a, b) if exact else torch.allclose(a, b, atol=1e-6), key

    resumed, info = _load(fsdp, f"resume-{name}")  # 2 processes: bit-identical weights and saved model
    same_iteration(resumed, exact=True)
    keys = [k for k in full_run if k.startswith("w/")]
    assert all(torch.equal(resumed[k], full_run[k]) for k in keys)
    model_file = ("pytorch_lora_weights.safetensors" if finetune == "lora"
                  else "transformer/diffusion_pytorch_model.safetensors")
    from safetensors.torch import load_file

    # Tensors, not bytes: the LoRA metadata lists peft's target_modules set, whose order varies between processes
    saved = [load_file(str(fsdp / d / "model" / model_file)) for d in (f"resume-{name}", name)]
    assert saved[0].keys() == saved[1].keys() and all(torch.equal(saved[0][k], saved[1][k]) for k in saved[0])

    # 1 FSDP process (torchrun --nproc_per_node 1, same environment): accelerate's full state dicts re-shard.
    resumed, info = _load(fsdp_one, f"resume-{name}")
    assert info["distributed"]["num_processes"] == 1
    same_iteration(resumed, exact=False)
    # 1e-3 of the ~2e-3 update (learning rate 1e-3, 2 Adam steps); measured: 2e-9 (LoRA), 1.5e-8 (full)
    print(f"\nresume on 1 FSDP process, {finetune}: max diff {_max_diff(resumed, full_run, keys):.3g}")
    assert _max_diff(resumed, full_run, keys) < 2e-6


@pytest.mark.slow
def test_an_fsdp_checkpoint_on_a_plain_process_is_refused_with_the_fix(fsdp, tmp_path):
    import trl_flow

    tr = fw.make(trl_flow.FlowGRPOTrainer, str(tmp_path / "plain"), "lora")
    with pytest.raises(ValueError, match="written under FSDP .*--accelerate_config fsdp2 --num_processes 1"):
        tr.train(resume_from_checkpoint=str(fsdp / "FlowGRPOTrainer-lora" / "checkpoint-1"))


@pytest.mark.slow
def test_op_grpo_under_fsdp_is_refused_with_the_fix(fsdp):
    error = json.loads((fsdp / "refuse-OPGRPOTrainer.json").read_text())["error"]
    assert error and error.startswith("DistributedSetupError") and "different numbers of transformer forward" in error
    assert "multi_gpu" in error


# ------------------------------------------------------------------------- a request accelerate would drop
def test_fsdp_request_that_accelerate_turns_into_nothing_is_refused(tmp_path, monkeypatch):
    """The fsdp2 environment without a process group (no GPU, CPU not forced): DistributedType.NO, refused."""
    import trl_flow
    from trl_flow.engine.distributed import DistributedSetupError

    for k, v in fsdp2_env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    with pytest.raises(DistributedSetupError, match=r"asks for FSDP but accelerate set up DistributedType.NO with 1 "
                                                    r"process.*ACCELERATE_USE_CPU=true"):
        mw.make_trainer(trl_flow.FlowGRPOTrainer, str(tmp_path / "out"))


@pytest.mark.parametrize("request_env, match", [
    ({"ACCELERATE_USE_DEEPSPEED": "true"}, "asks for DeepSpeed .* would train with DDP instead"),
    ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"}, "FSDP version 1 .* only FSDP2 runs on CPU"),
])
def test_sharding_requests_the_cpu_cannot_run_are_refused(tmp_path, monkeypatch, request_env, match):
    import trl_flow
    from trl_flow.engine.distributed import DistributedSetupError

    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    for k, v in request_env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(DistributedSetupError, match=match):
        mw.make_trainer(trl_flow.FlowGRPOTrainer, str(tmp_path / "out"))


def test_a_plain_run_records_its_distributed_type(tmp_path):
    import trl_flow

    tr = mw.make_trainer(trl_flow.FlowGRPOTrainer, str(tmp_path / "out"), max_steps=1)
    tr.train()
    state = json.loads((tmp_path / "out" / "checkpoint-1" / "trainer_state.json").read_text())
    assert state["distributed"] == {"distributed_type": "NO", "num_processes": 1}


@pytest.mark.parametrize("want, got, n, world, match", [
    ("FSDP", "MULTI_GPU", 2, 2, "asks for FSDP but accelerate set up DistributedType.MULTI_GPU"),
    ("DEEPSPEED", "NO", 1, 2, "DistributedType.NO with 1 process.*no GPU was found"),
    # measured with deepspeed 0.19.8 on this CPU machine (not installed in CI): accelerate reports DEEPSPEED with 1
    # process per copy while DeepSpeed's own gloo group has 2, and DeepSpeed then fails its batch-size check
    ("DEEPSPEED", "DEEPSPEED", 1, 2, "counts 1 of the launcher's 2 processes"),
    ("FSDP", "FSDP", 2, 2, None), (None, "MULTI_CPU", 2, 2, None), (None, "NO", 1, 1, None),
])
def test_what_accelerate_set_up_is_compared_with_the_request(want, got, n, world, match):
    import re

    from trl_flow.engine.distributed import mismatch

    problem = mismatch(want, got, n, world)
    assert (problem is None) if match is None else bool(re.search(match, problem)), problem
