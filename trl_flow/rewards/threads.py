"""Threads that never hold up the end of a process: the worker pools of overlapped scoring and remote rewards, and
reward calls with a time limit (``reward_timeout``).

A Python thread cannot be stopped, and :class:`concurrent.futures.ThreadPoolExecutor` joins its workers when the
interpreter exits: a reward that hangs in one of them keeps the process alive after the run has failed or been
interrupted (two SIGTERMs were not enough). The threads here are daemons: a call that is given up on keeps running
in the background until the process ends, and the process ends without waiting for it.

One hazard of daemon threads before Python 3.14: a daemon thread that takes the GIL back while the interpreter
shuts down is ended with ``pthread_exit``, which aborts the process (``terminate called without an active
exception``) when a C++ frame (e.g. a tensor being freed) is on its stack. So a pool's idle workers are joined at
shutdown, and a worker of a closed pool whose time-limited call runs out keeps waiting instead of waking up.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, wait

import torch


_local = threading.local()  # .pool: the DaemonPool whose worker this thread is


def _run(fut: Future, fn: Callable, args: tuple, kwargs: dict) -> None:
    if not fut.set_running_or_notify_cancel():  # cancelled before it started
        return
    try:
        result = fn(*args, **kwargs)
    except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
        fut.set_exception(e)
    else:
        fut.set_result(result)


def _caller_context():
    """A function that restores, in another thread, the caller's thread-local torch state (grad mode, CUDA device)."""
    grad = torch.is_grad_enabled()
    device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def enter():
        stack = contextlib.ExitStack()
        stack.enter_context(torch.set_grad_enabled(grad))
        if device is not None:
            stack.enter_context(torch.cuda.device(device))
        return stack

    return enter


class DaemonPool:
    """A fixed pool of ``num_workers`` daemon threads with the ``submit`` / ``map`` / ``shutdown`` of an executor.

    :meth:`shutdown` cancels the queued calls, waits for the idle workers to end (at once: they run nothing) and
    at most ``grace`` seconds for a running call, which is then left to finish (or hang) in the background. A worker
    marks itself idle before it publishes a result, so a worker whose result was seen is never left behind (a daemon
    thread that wakes up while the interpreter shuts down can abort the process). Used as a context manager, it shuts
    down on exit."""

    def __init__(self, num_workers: int, name: str = "trl_flow-reward"):
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"DaemonPool: num_workers={num_workers!r} must be an integer >= 1")
        self._items: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._busy: set[threading.Thread] = set()
        self._threads = [threading.Thread(target=self._worker, name=f"{name}_{i}", daemon=True)
                         for i in range(num_workers)]
        for t in self._threads:
            t.start()

    @property
    def closed(self) -> bool:
        return self._closed

    def _worker(self) -> None:
        me = threading.current_thread()
        _local.pool = self
        while True:
            with self._cond:
                while not self._items and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                fut, fn, args, kwargs = self._items.popleft()
                if not fut.set_running_or_notify_cancel():
                    continue
                self._busy.add(me)
            try:
                result, error = fn(*args, **kwargs), None
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                result, error = None, e
            with self._cond:
                self._busy.discard(me)
            if error is None:
                fut.set_result(result)
            else:
                fut.set_exception(error)
            del result, error

    def submit(self, fn: Callable, *args, **kwargs) -> Future:
        fut: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("DaemonPool: submit after shutdown")
            self._items.append((fut, fn, args, kwargs))
            self._cond.notify()
        return fut

    def map(self, fn: Callable, items: Iterable) -> list:
        """``[fn(x) for x in items]`` run in the pool, in order; the first error is raised and the rest cancelled."""
        futures = [self.submit(fn, x) for x in items]
        try:
            return [f.result() for f in futures]
        finally:
            for f in futures:
                f.cancel()

    def shutdown(self, grace: float = 1.0) -> None:
        """Cancel the queued calls and end the idle workers; a running call gets at most ``grace`` seconds (in
        all) to finish, then is left behind."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            for fut, *_ in self._items:
                fut.cancel()
            self._items.clear()
            idle = [t for t in self._threads if t not in self._busy]
            self._cond.notify_all()
        deadline = time.monotonic() + grace
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(None if t in idle else max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> DaemonPool:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


class CallTimeout(Exception):
    """:func:`call_with_timeout`: the call did not return in time (it is still running, in a daemon thread)."""


def call_with_timeout(fn: Callable, args: tuple, kwargs: dict, timeout: float | None):
    """``fn(*args, **kwargs)``, run in a daemon thread (with the caller's grad mode and CUDA device) when
    ``timeout`` is a positive number of seconds; raises :class:`CallTimeout` if it has not returned by then, and
    the call is abandoned. ``timeout`` None or 0: called directly, without a limit."""
    if not timeout:
        return fn(*args, **kwargs)
    enter = _caller_context()

    def call():
        with enter():
            return fn(*args, **kwargs)

    fut: Future = Future()
    thread = threading.Thread(target=_run, args=(fut, call, (), {}), name="trl_flow-reward-call", daemon=True)
    thread.start()
    done, _ = wait([fut], timeout)
    if not done:
        pool = getattr(_local, "pool", None)
        if pool is not None and pool.closed:  # nobody waits for this worker any more: never wake up (see above)
            wait([fut])
        raise CallTimeout(f"no answer within {timeout:g} s")
    # the call has returned: let its thread finish too (microseconds), so that no daemon thread is still unwinding
    # when a process that ends right after this call shuts down (the abort described above)
    thread.join()
    return fut.result()
