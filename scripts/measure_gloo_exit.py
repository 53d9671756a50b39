"""How often a gloo process aborts at interpreter exit when its process group is left alive, against destroyed.

    python scripts/measure_gloo_exit.py --trials 20 --world 5

Each trial starts ``--world`` processes that join a gloo group, run one ``all_gather`` and return, with and without
``destroy_process_group()``; a process that dies with SIGABRT (``terminate called without an active exception``)
has exit code -6. docs/distributed.md "The end of a multi-process run" quotes this script's counts.
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _body(rank: int, world: int, port: int, destroy: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out = [torch.empty(1) for _ in range(world)]
    dist.all_gather(out, torch.tensor([float(rank)]))
    if destroy:
        dist.destroy_process_group()


def trial(world: int, destroy: bool) -> list[int]:
    """Exit codes of one group of ``world`` processes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_body, args=(r, world, port, destroy)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    return [p.exitcode for p in procs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--world", type=int, default=5)
    args = parser.parse_args()
    for destroy in (False, True):
        codes = [c for _ in range(args.trials) for c in trial(args.world, destroy)]
        aborted = sum(c == -6 for c in codes)
        other = sum(c not in (0, -6) for c in codes)
        print(f"{'destroyed' if destroy else 'left alive'}: {aborted} of {len(codes)} processes aborted (SIGABRT)"
              + (f", {other} other failures" if other else ""))


if __name__ == "__main__":
    main()
