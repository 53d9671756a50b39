"""A trainer's distributed set-up: the accelerator a run really gets, model wrapping, and what sharding changes.

A run is what its launch config says, or it stops. The launcher tells the processes what was asked for
(``ACCELERATE_USE_FSDP`` / ``ACCELERATE_USE_DEEPSPEED``, set by ``accelerate launch`` from the config's
``distributed_type``); :func:`make_accelerator` compares it with what accelerate set up and raises
:class:`DistributedSetupError`, naming what happened and the fix, when the request was turned into DDP or into
nothing. :func:`describe` is what every run records (``trainer_state.json`` and its first log line).

FSDP2 on CPU. accelerate only selects FSDP on an accelerator device: with the CPU forced (``ACCELERATE_USE_CPU``)
it sets up ``MULTI_CPU`` (gloo) and would wrap the model in DDP, silently dropping the sharding. Its FSDP2 code
itself (``fully_shard`` block by block, DTensor-aware gradient clipping, ``no_sync``, ``save_state`` /
``load_state`` of sharded model and optimizer, ``get_state_dict``) runs on CPU processes over gloo. So for an FSDP2
request on CPU we keep accelerate's gloo process group and switch its state to FSDP with the plugin built from the
launcher's ``FSDP_*`` variables (:func:`_enable_cpu_fsdp2`): the rest of the run takes accelerate's own FSDP2
path. FSDP1 and DeepSpeed are refused on CPU (accelerate's FSDP1 path and DeepSpeed's ZeRO engine need a GPU here).

What sharding changes for the trainer (all here, so that the loop itself is the same under DDP and FSDP):
parameters become DTensors after ``prepare`` (the trainable list is rebuilt from the prepared model, EMA shadows
are DTensors too), the frozen reference copy of ``finetune="full"`` is sharded like the trained model, and every
export (LoRA file, EMA, ``save_model``) gathers full tensors on every process before the main one writes.

Collective timeout (``ddp_timeout``). A process that stops answering (stopped, hung, dead without its connections
closing) leaves the others waiting in their next collective. The process group is made with ``ddp_timeout`` seconds
(accelerate's ``InitProcessGroupKwargs``; applied to a group that already exists too), and a timed-out collective in
the training loop is re-raised as :class:`CollectiveTimeoutError` naming the option (:func:`collective_timeout_error`).
"""

from __future__ import annotations

import gc
import os
import re
import weakref
from datetime import timedelta

import torch


class DistributedSetupError(RuntimeError):
    """The launch asked for a distributed mode this run does not get."""


def _flag(name: str) -> bool:
    return os.environ.get(name, "false").strip().lower() in ("1", "true", "yes")


def requested() -> str | None:
    """The sharded mode the launcher asked for: ``"FSDP"``, ``"DEEPSPEED"`` or None (DDP / one process)."""
    if _flag("ACCELERATE_USE_DEEPSPEED"):
        return "DEEPSPEED"
    if _flag("ACCELERATE_USE_FSDP"):
        return "FSDP"
    return None


def _check_request_before(want: str | None) -> None:
    """Requests refused before accelerate is set up (it would drop them, or fail less clearly)."""
    if not _flag("ACCELERATE_USE_CPU"):
        return
    if want == "DEEPSPEED":
        raise DistributedSetupError(
            "the launch config asks for DeepSpeed (ACCELERATE_USE_DEEPSPEED=true) but the CPU is forced "
            "(ACCELERATE_USE_CPU=true): accelerate never enables DeepSpeed then and would train with DDP instead. "
            "Fix: run zero2 / zero3 on GPUs, or on CPU use --accelerate_config fsdp2 (FSDP2 shards over CPU "
            "processes) or multi_gpu (DDP)")
    if want == "FSDP" and os.environ.get("FSDP_VERSION", "1") != "2":
        raise DistributedSetupError(
            f"the launch config asks for FSDP version {os.environ.get('FSDP_VERSION', '1')} with the CPU forced "
            "(ACCELERATE_USE_CPU=true): only FSDP2 runs on CPU here. Fix: set fsdp_version: 2 (the shipped fsdp2 "
            "config does), or use multi_gpu (DDP)")


def make_accelerator(config, find_unused_parameters: bool = False):
    """The run's ``Accelerator``: what the launch asked for, or :class:`DistributedSetupError`.
    ``find_unused_parameters``: DDP's, for a trained module of which one forward pass uses only a part
    (:attr:`~trl_flow.models.FlowAdapter.partial_forward`)."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, DistributedType, InitProcessGroupKwargs

    want = requested()
    _check_request_before(want)
    mp = "bf16" if config.bf16 else "fp16" if config.fp16 else "no"
    timeout = timedelta(seconds=config.ddp_timeout)
    acc = Accelerator(mixed_precision=mp, log_with=config.report_to or None, project_dir=config.output_dir,
                      kwargs_handlers=[InitProcessGroupKwargs(timeout=timeout)]
                      + ([DistributedDataParallelKwargs(find_unused_parameters=True)]
                         if find_unused_parameters else []))
    _apply_timeout(timeout)
    register_exit_hook()  # a script of one's own needs no end_training() to exit cleanly
    got = acc.distributed_type
    if want == "FSDP" and got == DistributedType.MULTI_CPU:
        _enable_cpu_fsdp2(acc)
    else:
        problem = mismatch(want, got.value, acc.num_processes, int(os.environ.get("WORLD_SIZE", "1") or 1))
        if problem:
            raise DistributedSetupError(problem)
    acc.print(startup_line(describe(acc), str(acc.device), mp))
    return acc


def startup_line(info: dict, device: str, mixed_precision: str = "no") -> str:
    """The one line a run prints at start (main process): how many processes, on what, how they share the work,
    in which precision, e.g. ``trl_flow: training on 2 CPU processes, data parallel (DDP over gloo), float32``.
    ``info``: :func:`describe`'s."""
    n, kind = info["num_processes"], info["distributed_type"]
    on_cpu = device.startswith("cpu") or info.get("fsdp_on_cpu")
    what = "CPU" if on_cpu else device.split(":")[0].upper()
    if kind == "NO" or n == 1 and kind not in ("FSDP", "DEEPSPEED"):
        how = f"1 process on {device}"
    elif kind == "FSDP":
        how = (f"{n} {what} processes, parameters sharded (FSDP{info.get('fsdp_version', '')}, "
               f"{info.get('fsdp_state_dict_type', '').lower()} checkpoints)")
    elif kind == "DEEPSPEED":
        how = f"{n} {what} processes, DeepSpeed"
    elif kind in ("MULTI_CPU", "MULTI_GPU"):
        how = f"{n} {what} processes, data parallel (DDP over {'gloo' if on_cpu else 'NCCL'})"
    else:
        how = f"{n} processes ({kind})"
    precision = {"bf16": "bf16 mixed precision", "fp16": "fp16 mixed precision"}.get(mixed_precision, "float32")
    return f"trl_flow: training on {how}, {precision}"


# -------------------------------------------------------------------------------------- collective timeout
class CollectiveTimeoutError(RuntimeError):
    """A collective operation waited ``ddp_timeout`` seconds for another process."""


#: The process group's collective timeout in seconds, as :func:`make_accelerator` last set it.
_timeout_s: float | None = None

#: How torch's backends say that a collective timed out (gloo: a receive, or the pairs closed by the timeout of an
#: earlier one; NCCL: its watchdog, which then usually aborts the process before Python sees anything).
_TIMEOUT_MESSAGES = re.compile(r"Timed out waiting \d+ ?ms for \w+ operation|[Aa]pplication timeout caused pair "
                               r"closure|Watchdog caught collective operation timeout")


def _apply_timeout(timeout: timedelta) -> None:
    """accelerate passes ``InitProcessGroupKwargs`` only when it creates the process group; a group made earlier
    in the process (a ``PartialState()`` before the trainer, a second trainer) gets the timeout here."""
    global _timeout_s
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from torch.distributed import distributed_c10d

        setter = getattr(distributed_c10d, "_set_pg_timeout", None)  # torch >= 2.3
        if setter is not None:
            setter(timeout)
    _timeout_s = timeout.total_seconds()


def collective_timeout_error(error: BaseException) -> CollectiveTimeoutError | None:
    """``error`` (raised while the process group exists) said as a :class:`CollectiveTimeoutError` naming
    ``ddp_timeout`` and the likely causes when it is a timed-out collective; else None."""
    import torch.distributed as dist

    if isinstance(error, CollectiveTimeoutError) or not isinstance(error, RuntimeError):
        return None
    if not (dist.is_available() and dist.is_initialized()) or not _TIMEOUT_MESSAGES.search(str(error)):
        return None
    after = f"{_timeout_s:g} s (ddp_timeout={_timeout_s:g})" if _timeout_s is not None else "ddp_timeout seconds"
    first_line = str(error).strip().splitlines()[0]
    return CollectiveTimeoutError(
        f"process {dist.get_rank()} of {dist.get_world_size()}: a collective operation (a gather, the gradient "
        f"all-reduce or a barrier) waited {after} for another process that did not answer: it was stopped, it hangs "
        "(a reward call, a kernel, a full disk), or it is busy alone for longer (a large save or Hub upload on the "
        "main process). Complete checkpoints are untouched. Fix: check the other processes (the launcher's log "
        "names one that failed); if that wait is expected, raise ddp_timeout (seconds; --ddp_timeout on the "
        f"command line). [{type(error).__name__}: {first_line}]")


def mismatch(want: str | None, got: str, num_processes: int, world: int) -> str | None:
    """Why the set-up accelerate made (``got``: a DistributedType value, with ``num_processes`` of the launcher's
    ``world``) is not the requested ``want``, with the fix; None when it is."""
    if want is None:
        return None
    if got != want:
        why = ("no GPU was found and the CPU was not forced, so accelerate set up no process group"
               if got == "NO" else f"accelerate chose {got} instead")
        return (f"the launch config asks for {want} but accelerate set up DistributedType.{got} with {num_processes} "
                f"process(es) (WORLD_SIZE={world}): {why}; the requested sharding would be dropped. Fix: on GPUs "
                "check that they are visible (CUDA_VISIBLE_DEVICES); on CPU force it for FSDP2, e.g. "
                "`ACCELERATE_USE_CPU=true trl-flow grpo --accelerate_config fsdp2 --num_processes 2 ...`")
    if num_processes != world:
        # DeepSpeed without a GPU: DeepSpeed forms the process group (gloo, its CPU accelerator), but accelerate
        # finds no device backend and counts 1 process per copy; DeepSpeed then rejects the batch arithmetic.
        return (f"the launch config asks for {want}: accelerate set up DistributedType.{got} but counts "
                f"{num_processes} of the launcher's {world} processes (it found no GPU, so it did not join the "
                f"process group {want} formed). Fix: run {want} on GPUs; on CPU use --accelerate_config fsdp2 (FSDP2 "
                "shards over CPU processes, with ACCELERATE_USE_CPU=true) or multi_gpu (DDP)")
    return None


def _enable_cpu_fsdp2(acc) -> None:
    """Switch accelerate's CPU (gloo) state to its FSDP2 path, with the plugin the launcher's FSDP_* variables give."""
    from accelerate import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin()  # reads FSDP_VERSION, FSDP_STATE_DICT_TYPE, ... like accelerate does
    if plugin.fsdp_version != 2:
        raise DistributedSetupError(f"fsdp_version={plugin.fsdp_version}: only FSDP2 runs on CPU; set fsdp_version: 2")
    acc.state.fsdp_plugin = plugin
    acc.state.distributed_type = DistributedType.FSDP
    # AcceleratorState copies PartialState's shared state whenever it is built again: switch both.
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    acc.state.fsdp_on_cpu = True


def is_fsdp(acc) -> bool:
    return acc.distributed_type.value == "FSDP"


def describe(acc) -> dict:
    """What a run records: accelerate's distributed type and process count (and the FSDP settings)."""
    info = {"distributed_type": acc.distributed_type.value, "num_processes": acc.num_processes}
    if is_fsdp(acc):
        plugin = acc.state.fsdp_plugin
        info.update(fsdp_version=plugin.fsdp_version, fsdp_state_dict_type=plugin.state_dict_type.name,
                    fsdp_on_cpu=bool(getattr(acc.state, "fsdp_on_cpu", False)))
    return info


def check_trainer(trainer) -> None:
    """Sharding needs every process to run the same forward passes (FSDP gathers each block's weights in each)."""
    acc = trainer.accelerator
    if not is_fsdp(acc) or acc.num_processes == 1:
        return
    # A trainer whose processes may run different numbers of transformer forward passes in an iteration (OP-GRPO: a
    # process's replayed tails are shorter than its fresh trajectories) sets `uneven_forwards`. FSDP gathers every
    # block's parameters in every forward pass, from every process, so such a method would deadlock under FSDP.
    if getattr(trainer, "uneven_forwards", False):
        raise DistributedSetupError(
            f"{type(trainer).__name__} under FSDP with {acc.num_processes} processes: its processes run different "
            "numbers of transformer forward passes (replayed trajectories regenerate only their tails), which FSDP "
            "cannot do (every forward pass gathers the weights from every process). Fix: --accelerate_config "
            "multi_gpu (DDP), or one process")
    n_eval = len(trainer.eval_dataset) if trainer.eval_dataset is not None else 0
    if trainer.config.eval_steps and n_eval % acc.num_processes:
        raise DistributedSetupError(
            f"eval_dataset: {n_eval} prompts do not split evenly over {acc.num_processes} FSDP processes (each "
            "process must generate as many images); use a multiple of the process count, or eval_steps=0")


# ------------------------------------------------------------------------------------------------ wrapping
def prepare(acc, transformer, optimizer, ref_model=None, save_hook=None, load_hook=None):
    """``accelerator.prepare`` the trained transformer and its optimizer; returns (model, optimizer, trainable
    parameters, reference copy).

    The trainable parameters are read from the prepared model (FSDP2 replaces every parameter by a DTensor one); the
    frozen reference copy (``finetune="full"``, ``beta > 0``) is sharded like the model; the caller's save-state /
    load-state pre-hooks are registered (the checkpoints' LoRA file, for a LoRA run)."""
    model, optimizer = acc.prepare(transformer, optimizer)
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        _ddp_models.add(model)  # released at the end of the process (release_ddp_models)
    trainable_params = [p for p in model.parameters() if p.requires_grad]
    if is_fsdp(acc) and ref_model is not None:
        from accelerate.utils.fsdp_utils import fsdp2_prepare_model

        ref_model = fsdp2_prepare_model(acc, ref_model)
        # Forward passes only: reshard the root's parameters after each too (accelerate keeps the trained root's
        # gathered until its backward pass, which the reference never has).
        ref_model.set_reshard_after_forward(True)
    if save_hook is not None:
        acc.register_save_state_pre_hook(save_hook)
    if load_hook is not None:
        acc.register_load_state_pre_hook(load_hook)
    return model, optimizer, trainable_params, ref_model


def full_tensors(tensors):
    """DTensors gathered to full (CPU) tensors, others detached to CPU: a dict or a list. With sharding this is a
    collective: every process calls it, in the same order."""
    from torch.distributed.tensor import DTensor

    def full(t):
        t = t.detach()
        return (t.full_tensor() if isinstance(t, DTensor) else t).cpu().contiguous()

    if isinstance(tensors, dict):
        return {k: full(v) for k, v in tensors.items()}
    return [full(t) for t in tensors]


def like(full: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``full`` placed like ``ref``: sharded the same way if ``ref`` is a DTensor, else on its device."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(ref, DTensor):
        return distribute_tensor(full.to(ref.device_mesh.device_type, ref.dtype), ref.device_mesh, ref.placements)
    return full.to(ref.device, ref.dtype)


def lora_state_dict(trainer) -> dict:
    """The trained adapter's weights as full CPU tensors (peft names); every process calls it."""
    from peft.utils import get_peft_model_state_dict

    return full_tensors(get_peft_model_state_dict(trainer.accelerator.unwrap_model(trainer.model)))


# ------------------------------------------------------------------------------------------ resume, end
FSDP_MODEL_PREFIX = "pytorch_model_fsdp"


def check_resume(trainer, path: str, saved_processes: int | None) -> None:
    """A checkpoint holds either sharded (FSDP) or plain model and optimizer files; a run of the other kind cannot
    read it: refuse, naming the launch that can."""
    acc = trainer.accelerator
    saved_fsdp = any(name.startswith(FSDP_MODEL_PREFIX) for name in os.listdir(path))
    n = f"{saved_processes} processes" if saved_processes else "several processes"
    if saved_fsdp and not is_fsdp(acc):
        raise ValueError(
            f"resume_from_checkpoint: {path} was written under FSDP ({n}; {FSDP_MODEL_PREFIX}* files), this run is "
            f"DistributedType.{acc.distributed_type.value} with {acc.num_processes} process(es) and cannot read it. "
            "Resume it under FSDP, on any number of processes: e.g. `ACCELERATE_USE_CPU=true trl-flow <command> "
            "--accelerate_config fsdp2 --num_processes 1 ...` (or torchrun --nproc_per_node 1 with the fsdp2 "
            "environment); the LoRA file in it loads anywhere with pipe.load_lora_weights")
    if is_fsdp(acc) and not saved_fsdp:
        raise ValueError(
            f"resume_from_checkpoint: {path} was written without FSDP ({n}), this run is FSDP: resume it with the "
            "launch it was written with (multi_gpu, or one process)")


def end_processes() -> None:
    """The last step of a process that ran to the end (the CLI's): wait for the others, then destroy the process
    group (accelerate's shared state does both) and release it from the DDP models (:func:`release_ddp_models`).
    Left to interpreter exit, gloo's worker threads can be destroyed while still joinable, and the process aborts
    (SIGABRT, ``terminate called without an active exception``) after its work is done. Not after an error: a peer
    may still be waiting in a collective. One process: nothing to do."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        from accelerate import PartialState

        state = PartialState()
        state.wait_for_everyone()
        state.destroy_process_group()
    release_ddp_models()


#: The DDP-wrapped models :func:`prepare` made, while they exist.
_ddp_models: "weakref.WeakSet" = weakref.WeakSet()


def release_ddp_models() -> None:
    """Make the models :func:`prepare` wrapped in DDP let go of the process group, once it is destroyed (or being
    destroyed at exit): ``destroy_process_group()`` only unregisters the group, and a DDP model's reducer, logger
    and ``process_group`` keep it, with its gloo threads, alive until the interpreter's teardown frees the model,
    where a gloo thread freeing its last work can abort the process (``terminate called without an active
    exception``; a finished rank of a 2-process test aborted so in two of three clean-clone CI runs). Measured in a
    2-process CLI run: at exit, 2 ``pt_gloo_runloop`` threads and a ``gloo_tcp_loop`` one still ran in each process
    after ``destroy_process_group()``; none after this (``tests/test_cli_accelerate.py`` counts them). The DDP
    wrappers cannot run a step afterwards; their modules (``model.module``) and parameters are untouched."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return  # the group is still in use
    models = list(_ddp_models)
    if not models:
        return
    _ddp_models.clear()
    for model in models:
        for name in ("logger", "reducer", "process_group"):  # the logger holds the reducer, which holds the group
            model.__dict__.pop(name, None)
    del models
    gc.collect()  # a model in a reference cycle (e.g. with its trainer) lets go now, not at teardown


_exit_hook_registered = False


def destroy_at_exit() -> None:
    """At interpreter exit: destroy the process group if it is still there. Left to the interpreter's teardown,
    gloo's worker threads can be destroyed while still joinable and a finished process aborts (SIGABRT,
    ``terminate called without an active exception``): 5-6 of 100 gloo processes (``scripts/measure_gloo_exit.py``).
    Under gloo the processes first meet in a barrier bounded by :data:`EXIT_BARRIER_S` (destroying a group while a
    peer's gloo threads still talk to it aborted a finished process in the tracked-run test); a process that exits
    after an error, while a peer still waits in a collective, stops waiting after that bound. Then the DDP models
    let go of the group (:func:`release_ddp_models`), before the interpreter's teardown."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            if dist.get_backend() == "gloo" and dist.get_world_size() > 1:
                from datetime import timedelta

                dist.monitored_barrier(timeout=timedelta(seconds=EXIT_BARRIER_S), wait_all_ranks=True)
        except Exception:  # a peer that stopped or is still busy: destroy this process's group all the same
            pass
        try:
            dist.destroy_process_group()
        except Exception:  # at exit: a group that cannot be destroyed is left as it was
            pass
    release_ddp_models()  # also after a script's own end_training(); nothing while a group is still in use


#: Seconds the processes of a gloo group wait for each other at interpreter exit before destroying it.
EXIT_BARRIER_S = 10.0


def register_exit_hook() -> None:
    """Register :func:`destroy_at_exit` with ``atexit`` once per process (every trainer calls this when it makes its
    accelerator): ``save_model`` / ``push_to_hub`` / ``evaluate`` after ``train()`` keep the group, and a script of
    one's own ends cleanly without ``trainer.accelerator.end_training()``."""
    global _exit_hook_registered
    if not _exit_hook_registered:
        import atexit

        atexit.register(destroy_at_exit)
        _exit_hook_registered = True


def agree(accelerator, error: str | None) -> str | None:
    """The first error message any process has (every process calls this; with one process a no-op)."""
    if accelerator.num_processes == 1:
        return error
    from accelerate.utils import gather_object

    return next((e for e in gather_object([error]) if e), None)
