"""Deferred interrupts: SIGINT / SIGTERM finish the iteration, which is saved; a second signal stops at once.

One signal often arrives more than once: a scheduler (Slurm, systemd) signals every process of a job, and the
launcher (torchrun, ``accelerate launch``) forwards its own copy to each worker a few milliseconds later. Copies that
arrive within ``InterruptGuard.COALESCE_S`` seconds of the first count once; only a later one means "stop now".

A Python signal handler runs only in the main thread, between bytecodes. While the main thread waits in native code
(a collective blocked on a process that was stopped or hangs, a long kernel) no handler runs: the first signal is
acted on only when that call returns, and a second one would be lost the same way. So the guard also starts a
watcher thread, woken by every handled signal through :func:`signal.set_wakeup_fd`: after a second SIGINT / SIGTERM
it gives the main thread ``FORCE_EXIT_AFTER_S`` seconds to stop by itself (the handler's ``KeyboardInterrupt``) and
otherwise ends the process with ``os._exit(128 + signum)``, the status of a process killed by that signal. Nothing
is written then; complete checkpoints are untouched (a save in progress leaves only its ``.tmp`` folder).

A collective that times out inside the guard (another process stopped answering for ``ddp_timeout`` seconds) is
re-raised as :class:`~trl_flow.engine.distributed.CollectiveTimeoutError`, which names the option.
"""

from __future__ import annotations

import _thread
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

import torch

#: Write ends of the wakeup pipes of guards active in this process; a forked child stops writing to them.
_ACTIVE_WAKEUP_FDS: set[int] = set()


def _after_fork_in_child() -> None:
    """A child forked inside a guard would count its own signals into the parent's watcher: unset its wakeup fd."""
    if _ACTIVE_WAKEUP_FDS:
        _ACTIVE_WAKEUP_FDS.clear()
        try:
            signal.set_wakeup_fd(-1)
        except ValueError:  # not the main thread of the child
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class InterruptGuard:
    """Defer SIGINT / SIGTERM to the end of the current iteration.

    The first signal is recorded (and announced); :meth:`stop_requested` at the iteration boundary then tells the
    loop, on every process at the same iteration, to save the complete state and stop. A second signal raises
    ``KeyboardInterrupt`` at once: the partial iteration is discarded, complete checkpoints are untouched (a save
    in progress only leaves its ``.tmp`` folder); if the main thread is blocked outside Python and does not stop
    within ``FORCE_EXIT_AFTER_S`` seconds, the process exits with status ``128 + signum``. Handlers (and the
    watcher thread) are installed only from the main thread."""

    SIGNALS = ("SIGINT", "SIGTERM")
    #: Copies of one signal that arrive within this many seconds of the first count once: a launcher (torchrun,
    #: ``accelerate launch``) forwards the SIGTERM that Slurm / systemd / Kubernetes also send to each process,
    #: a few milliseconds after the process's own copy. Only a signal later than this means "stop now".
    COALESCE_S = 2.0
    #: After a second signal, how long the main thread gets to raise ``KeyboardInterrupt`` and leave the guard
    #: before the watcher ends the process (it runs Python within microseconds unless blocked in native code).
    FORCE_EXIT_AFTER_S = 3.0

    def __init__(self, print_fn=print, on_first_signal: Callable[[int], None] | None = None):
        self.signum: int | None = None
        self._handled = 0  # calls of the handler
        self._raised = False  # the handler raised KeyboardInterrupt for a second, distinct signal
        self._first_at: float | None = None  # monotonic time of the first signal (handler's view, no watcher)
        #: called once, from the watcher thread, when the first signal arrives (whatever the main thread does)
        self._on_first_signal = on_first_signal
        self._previous: dict = {}
        self._print = print_fn
        self._watcher: _SignalWatcher | None = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for name in self.SIGNALS:
                sig = getattr(signal, name, None)
                if sig is not None:
                    self._previous[sig] = signal.signal(sig, self._handle)
            self._watcher = _SignalWatcher({int(s) for s in self._previous}, self.FORCE_EXIT_AFTER_S,
                                           lambda: self._raised, self.COALESCE_S, self._on_first_signal)
        return self

    def __exit__(self, exc_type=None, exc=None, tb=None):
        if self._watcher is not None:  # first: it re-raises signals while it runs
            self._watcher.stop()
            self._watcher = None
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        if exc is not None:
            from .distributed import collective_timeout_error

            error = collective_timeout_error(exc)
            if error is not None:
                raise error from exc
        return False

    def _handle(self, signum, frame):
        self._handled += 1
        now = time.monotonic()
        if self._handled == 1:
            self.signum, self._first_at = signum, now
            self._print(f"\n{signal.Signals(signum).name} received: finishing this iteration, then saving a "
                        "checkpoint and stopping (send it again to stop now without saving).")
        elif not self._raised and self._is_second_signal(now):
            self._raised = True
            self.__exit__()
            raise KeyboardInterrupt
        # otherwise: a copy of the first signal (a launcher's forward), or one the watcher re-raised just as the
        # second arrived (already stopping)

    def _is_second_signal(self, now: float) -> bool:
        """A distinct second signal, not a copy of the first: more than ``COALESCE_S`` after this handler's first
        call, or the watcher saw two signals that far apart (it reads them as they arrive, while this handler may
        run late, and pending signals of one kind reach it merged; a late first call only shortens the gap seen
        here, so a copy is never taken for a second signal)."""
        if self._watcher is not None:
            if self._watcher.distinct >= 2:
                return True
            if self._watcher.seen >= self._handled:
                # the watcher has read every delivery this handler has run for and found copies: this call is one
                # that ran late (the main thread was in a collective or native call), not a later signal
                return False
        return now - (self._first_at or now) > self.COALESCE_S

    def stop_requested(self, accelerator) -> int | None:
        """The signal any process received (all processes agree), or None."""
        flag = torch.tensor([float(self.signum or 0)], device=accelerator.device)
        if accelerator.num_processes > 1:
            flag = accelerator.reduce(flag, reduction="max")
        return int(flag.item()) or None

    @staticmethod
    def exception(signum: int) -> BaseException:
        """What the loop raises after saving: KeyboardInterrupt for SIGINT, SystemExit(128 + n) otherwise (the
        exit status of a process killed by that signal)."""
        if signum == signal.SIGINT:
            return KeyboardInterrupt()
        return SystemExit(128 + signum)


class _SignalWatcher:
    """A daemon thread counting the guarded signals through the wakeup fd (written by Python's C-level handler,
    whatever the main thread is doing); after the second it waits ``grace`` seconds for :meth:`stop` (the main
    thread's handler raising ``KeyboardInterrupt``), then exits the process. Created and stopped from the main
    thread."""

    POLL_S = 0.05

    def __init__(self, signums: set[int], grace: float, raised: Callable[[], bool], coalesce_s: float = 0.0,
                 on_first: Callable[[int], None] | None = None):
        self._signums, self._grace, self._raised = signums, grace, raised
        self._coalesce_s, self._on_first = coalesce_s, on_first
        #: signals seen, copies arriving within ``coalesce_s`` of the first counted once
        self.distinct = 0
        #: deliveries of the guarded signals read so far, copies included
        self.seen = 0
        self._on_first_thread: threading.Thread | None = None
        self._done = threading.Event()
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)  # the C handler must never block on a full pipe
        self._previous_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        _ACTIVE_WAKEUP_FDS.add(self._write)
        self._thread = threading.Thread(target=self._run, name="trl_flow-interrupt-watcher", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        first_at, last = None, None
        while not self._done.is_set():
            try:
                data = os.read(self._read, 512)
            except OSError:
                return
            now = time.monotonic()
            for signum in data:
                if signum not in self._signums:
                    continue
                self.seen += 1
                if first_at is None:
                    first_at, last, self.distinct = now, signum, 1
                    self._start_on_first(signum)
                elif now - first_at > self._coalesce_s:
                    last, self.distinct = signum, 2
            if self.distinct >= 2:
                self._second(last)
                return

    def _start_on_first(self, signum: int) -> None:
        """Run the first-signal callback (the preemption checkpoint) in its own daemon thread, so that this one
        keeps counting signals meanwhile."""
        if self._on_first is not None:
            self._on_first_thread = threading.Thread(target=self._on_first, args=(signum,),
                                                     name="trl_flow-preemption-save", daemon=True)
            self._on_first_thread.start()

    def _second(self, signum: int) -> None:
        """Signals that arrive before the main thread runs its handler are merged into one call (e.g. two sent
        while it waits for a reward thread): re-raise the one its handler has not seen, until it has seen two.
        Blocked in native code it sees none: end the process after the grace period."""
        end = time.monotonic() + self._grace
        while not self._done.wait(self.POLL_S):
            if not self._raised():
                _thread.interrupt_main(signum)
            if time.monotonic() > end:
                print(f"\n{signal.Signals(signum).name} received again and the process is blocked outside Python "
                      "(e.g. a collective waiting for a process that stopped, see ddp_timeout): exiting now without "
                      "saving; complete checkpoints are untouched.", file=sys.stderr, flush=True)
                self.finish_first_signal_work()
                os._exit(128 + signum)

    #: How long a forced exit waits for the first signal's work (the preemption checkpoint being written) to end.
    FIRST_WORK_WAIT_S = 10.0

    def finish_first_signal_work(self) -> None:
        """Let a preemption checkpoint that is being written complete (bounded) before the process ends."""
        if self._on_first_thread is not None:
            self._on_first_thread.join(self.FIRST_WORK_WAIT_S)

    def stop(self) -> None:
        self._done.set()
        _ACTIVE_WAKEUP_FDS.discard(self._write)
        try:
            signal.set_wakeup_fd(self._previous_fd)
        except ValueError:
            pass
        try:
            os.write(self._write, b"\0")  # wakes the thread's read (0 is no signal)
        except OSError:
            pass
        self._thread.join(timeout=1.0)
        for fd in (self._read, self._write):
            try:
                os.close(fd)
            except OSError:
                pass
