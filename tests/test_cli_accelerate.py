"""The shipped accelerate configs load with accelerate's own config classes and launch validation, and the CPU
two-process launch really starts two processes that train together."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from trl_flow import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPECTED = {"single_gpu", "multi_gpu", "multi_node", "fsdp2", "zero2", "zero3"}


def _launch_args(path):
    """What `accelerate launch --config_file <path> x.py` resolves (its own validation merges the file in)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    args = launch_command_parser().parse_args(["--config_file", path, "x.py"])
    args, defaults, _ = _validate_launch_command(args)
    return args, defaults


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_shipped_accelerate_config_loads(name):
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
    from accelerate.utils import DistributedType, patch_environment

    path = cli.shipped("accelerate_configs")[name]
    text = open(path).read()
    assert text.startswith(f"# {name}:") and "When:" in text  # each file says what it is and when to use it
    config = load_config_from_file(path)  # unknown keys or values raise here
    assert isinstance(config, ClusterConfig) and config.mixed_precision == "no"
    expected_type = {"single_gpu": DistributedType.NO, "fsdp2": DistributedType.FSDP,
                     "zero2": DistributedType.DEEPSPEED, "zero3": DistributedType.DEEPSPEED}
    assert config.distributed_type == expected_type.get(name, DistributedType.MULTI_GPU)
    args, defaults = _launch_args(path)
    if name == "fsdp2":
        from accelerate.utils import FullyShardedDataParallelPlugin
        from accelerate.utils.launch import prepare_multi_gpu_env

        with patch_environment(**{k: v for k, v in prepare_multi_gpu_env(args).items() if k.startswith("FSDP")}):
            plugin = FullyShardedDataParallelPlugin()
        assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    if name in ("zero2", "zero3"):
        from accelerate.utils import DeepSpeedPlugin
        from accelerate.utils.launch import prepare_deepspeed_cmd_env

        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
        _, env = prepare_deepspeed_cmd_env(args)
        with patch_environment(**{k: v for k, v in env.items() if k.startswith("ACCELERATE_DEEPSPEED")}):
            plugin = DeepSpeedPlugin()
        assert plugin.deepspeed_config["zero_optimization"]["stage"] == int(name[-1])
    if name == "multi_node":
        assert config.num_machines == 2 and config.num_processes == 16 and config.main_process_port == 29500


def test_every_shipped_config_is_expected():
    assert set(cli.shipped("accelerate_configs")) == EXPECTED


REWARD_MODULE = '''
import os

def rank_reward(images, prompts, **kwargs):
    """brightness; records which process scored how many images."""
    from accelerate import PartialState

    state = PartialState()
    with open(os.path.join(os.environ["RANK_LOG_DIR"], f"{state.process_index}-{os.getpid()}"), "a") as f:
        f.write(f"{state.num_processes} {len(prompts)}\\n")
    return images.mean(dim=(1, 2, 3)).tolist()
'''


def test_cpu_two_process_launch_trains_with_two_processes(tmp_path):
    """`ACCELERATE_USE_CPU=true trl-flow grpo --accelerate_config multi_gpu --num_processes 2 ...` (the CPU recipe,
    one iteration): two processes, one per rank, each scoring half of the iteration's images."""
    (tmp_path / "rank_rewards.py").write_text(REWARD_MODULE)
    logs = tmp_path / "ranks"
    logs.mkdir()
    out = tmp_path / "out"
    env = dict(os.environ, ACCELERATE_USE_CPU="true", RANK_LOG_DIR=str(logs), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([ROOT, str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "trl_flow.cli", "grpo", "--accelerate_config", "multi_gpu", "--num_processes", "2",
           "--config", "shapes_flow_grpo", "--reward_funcs", "rank_rewards:rank_reward", "--max_steps", "1",
           "--eval_steps", "0", "--prompts_per_step", "2", "--num_generations", "2",
           "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1", "--output_dir", str(out),
           "--disable_tqdm", "true"]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = {name.split("-")[0]: open(logs / name).read().split("\n")[:-1] for name in os.listdir(logs)}
    assert set(records) == {"0", "1"}  # two ranks, two different processes (one file each)
    # Each process: the constructor's check on 2 grey images, then its half (2 of 4) of the iteration's images.
    assert all(lines == ["2 2", "2 2"] for lines in records.values()), records
    history = [json.loads(line) for line in open(out / "log_history.jsonl")]
    assert [h["step"] for h in history] == [1] and os.path.exists(out / "pytorch_lora_weights.safetensors")
