"""The 2-process worker of tests/test_callbacks.py (run by torchrun): a callback whose flags differ per process.

At iteration 1 the main process stops the run and process 1 asks for a checkpoint and an evaluation; the main
process's flags decide on both (a checkpoint or an evaluation on one process alone would wait forever in its
collectives). Each process writes what it saw into ``OUT/rank<r>.json``.

    ACCELERATE_USE_CPU=1 python -m torch.distributed.run --nproc_per_node 2 tests/callbacks_worker.py OUT
"""

from __future__ import annotations

import json
import os
import sys

import torch
from transformers import TrainerCallback

from multiprocess_worker import make_trainer


class Disagree(TrainerCallback):
    def __init__(self, rank: int):
        self.rank, self.events = rank, []

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            if self.rank == 0:
                control.should_training_stop = True
            else:
                control.should_save = control.should_evaluate = True

    def on_save(self, args, state, control, **kwargs):
        self.events.append(["on_save", state.global_step])

    def on_train_end(self, args, state, control, **kwargs):
        self.events.append(["on_train_end", state.global_step])


def main(out: str) -> None:
    import trl_flow

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    callback = Disagree(rank)
    trainer = make_trainer(trl_flow.FlowGRPOTrainer, os.path.join(out, "run"), max_steps=3, save_steps=0)
    trainer.callback_handler.add_callback(callback)
    trainer.train()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"global_step": trainer.state.global_step, "events": callback.events,
                   "log_steps": [e["step"] for e in trainer.state.log_history]}, f)
    from trl_flow.engine.distributed import end_processes

    end_processes()


if __name__ == "__main__":
    main(sys.argv[1])
