"""One process of tests/test_multiprocess_stop.py's 2-process runs, started directly by the test (no launcher,
so that the test can wait on each process): the torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR, ...) comes
from the test.

    ACCELERATE_USE_CPU=1 RANK=r WORLD_SIZE=2 ... \\
        python tests/multiprocess_stop_worker.py OUT MARKERS DDP_TIMEOUT [early]

Flow-GRPO on the tiny pipeline; with ``early`` the process group is made before the trainer (``PartialState()``, as
many scripts do), so the trainer must apply ``ddp_timeout`` to an existing group. In the first iteration's reward call
each process writes ``MARKERS/scored-<rank>`` (with its pid); rank 1 then stops itself (SIGSTOP), so rank 0 waits for
it in the next collective.
"""

from __future__ import annotations

import os
import signal
import sys

import torch


def stopping_reward(images, prompts, **kwargs):
    stopping_reward.calls += 1
    if stopping_reward.calls == 2:  # 1: the constructor's check; 2: iteration 1
        rank = int(os.environ["RANK"])
        with open(os.path.join(sys.argv[2], f"scored-{rank}"), "w") as f:
            f.write(str(os.getpid()))
        if rank == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
    return images.mean(dim=(1, 2, 3))


stopping_reward.calls = 0


def main(out: str, ddp_timeout: float, early: bool) -> None:
    from trl_flow import FlowGRPOConfig, FlowGRPOTrainer
    from trl_flow.testing import tiny_sd3_pipeline

    torch.set_num_threads(1)
    if early:
        from accelerate import PartialState

        PartialState(cpu=True)  # the process group (gloo), with torch's default timeout
    config = FlowGRPOConfig(output_dir=out, max_steps=3, num_generations=2, prompts_per_step=2,
                            per_device_train_batch_size=2, height=32, width=32, max_sequence_length=16,
                            num_inference_steps=2, guidance_scale=1.0, lora_r=4, lora_alpha=8, beta=0.0,
                            disable_tqdm=True, ddp_timeout=ddp_timeout, reward_timeout=0)
    trainer = FlowGRPOTrainer(config, tiny_sd3_pipeline(), [stopping_reward], train_dataset=["a cat", "a dog"])
    trainer.train()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main(sys.argv[1], float(sys.argv[3]), sys.argv[4:] == ["early"])
