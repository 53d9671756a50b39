"""Child process of tests/test_checkpoints.py's kill test: an OP-GRPO run (a checkpoint per iteration) that resumes
from the newest complete checkpoint of its output_dir if there is one, and announces its saves on stdout.

    python tests/checkpoints_child.py OUTPUT_DIR MAX_STEPS HANG_IN_SAVE_OF_STEP REWARD_SECONDS

With HANG_IN_SAVE_OF_STEP = n > 0 the save of checkpoint-n stops for a minute half-way (for a kill mid-save).
Every reward call takes at least REWARD_SECONDS, so that an iteration lasts longer than the parent's random delay.
"""

import os
import sys
import time

import torch

torch.set_num_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import multiprocess_worker as mw  # noqa: E402
import trl_flow  # noqa: E402
from trl_flow.engine import checkpoints  # noqa: E402

out, max_steps = sys.argv[1], int(sys.argv[2])
hang_at, reward_seconds = int(sys.argv[3]), float(sys.argv[4])
trainer = mw.make_trainer(trl_flow.OPGRPOTrainer, out, max_steps=max_steps)
save_extra = trainer.save_extra_state


def slow_save_extra(path):  # runs inside the save, after accelerate's files and before the marker
    print(f"SAVE {trainer.state.global_step}", flush=True)
    if trainer.state.global_step == hang_at:
        time.sleep(60)
    save_extra(path)


trainer.save_extra_state = slow_save_extra
reward = trainer.reward


def slow_reward(*args):
    time.sleep(reward_seconds)
    return reward(*args)


trainer.reward = slow_reward
complete, _ = checkpoints.find_checkpoints(out)
print("READY", flush=True)
trainer.train(resume_from_checkpoint=True if complete else None)
print("DONE", flush=True)
