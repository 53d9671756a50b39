"""How often a gloo process aborts at interpreter exit when its process group is left alive, against destroyed.

    python scripts/measure_gloo_exit.py --trials 20 --world 5 [--modes alive destroyed atexit]

Each trial starts ``--world`` processes that join a gloo group, run one ``all_gather`` and return: with the group
left alive, destroyed (``destroy_process_group()``), or left to the exit hook every trainer registers
(``trl_flow.engine.distributed.register_exit_hook``: ``atexit`` destroys it); a process that dies with SIGABRT
(``terminate called without an active exception``) has exit code -6. docs/distributed.md "The end of a
multi-process run" quotes this script's counts.
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


MODES = ("alive", "destroyed", "atexit")


def _body(rank: int, world: int, port: int, mode: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if mode == "atexit":
        from trl_flow.engine.distributed import register_exit_hook

        register_exit_hook()
    out = [torch.empty(1) for _ in range(world)]
    dist.all_gather(out, torch.tensor([float(rank)]))
    if mode == "destroyed":
        dist.destroy_process_group()


def trial(world: int, mode: str) -> list[int]:
    """Exit codes of one group of ``world`` processes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_body, args=(r, world, port, mode)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    return [p.exitcode for p in procs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--world", type=int, default=5)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    args = parser.parse_args()
    for mode in args.modes:
        codes = [c for _ in range(args.trials) for c in trial(args.world, mode)]
        aborted = sum(c == -6 for c in codes)
        other = sum(c not in (0, -6) for c in codes)
        label = {"alive": "left alive", "destroyed": "destroyed", "atexit": "trainer's exit hook"}[mode]
        print(f"{label}: {aborted} of {len(codes)} processes aborted (SIGABRT)"
              + (f", {other} other failures" if other else ""))


if __name__ == "__main__":
    main()
