"""Train with any trl_flow trainer: a thin wrapper over the ``trl-flow`` command line (``trl_flow/cli.py``).

    python examples/train.py --method op_grpo --config shapes_op_grpo --max_steps 5

is ``trl-flow op-grpo --config shapes_op_grpo --max_steps 5``; every other option is the CLI's (see docs/cli.md
and ``trl-flow grpo --help``). ``--method`` picks the trainer by its registered name or alias
(``trl_flow.registered_trainers()``: grpo / flow_grpo (default), op-grpo / op_grpo, stepwise, dppo / flow_dppo,
nft / diffusion_nft, and any trainer registered with ``trl_flow.register_trainer``). The older option names
``--dataset``, ``--reward`` and ``--torch_dtype`` are still accepted for ``--dataset_name``, ``--reward_funcs`` and
``--dtype``.

GPU (the published Flow-GRPO recipe on SD3.5-M, PickScore reward, 8 GPUs):

    python examples/train.py --method flow_grpo --accelerate_config multi_gpu --num_processes 8 \\
        --config sd35m_flow_grpo_pickscore
"""

from __future__ import annotations

import sys

from trl_flow.cli import canonical, commands, run

RENAMED = {"--dataset": "--dataset_name", "--reward": "--reward_funcs", "--torch_dtype": "--dtype"}


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    method = "flow_grpo"
    if "--method" in argv:
        i = argv.index("--method")
        method = argv[i + 1] if i + 1 < len(argv) else ""
        del argv[i : i + 2]
    if method not in commands():
        raise SystemExit(f"--method {method!r}: choose one of {', '.join(commands())}")
    return run(canonical(method), [RENAMED.get(a, a) for a in argv])


if __name__ == "__main__":
    main()
