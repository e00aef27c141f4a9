"""Liveness of the other processes of a multi-process run, so that one dying stops the rest at once.

A process killed outright (SIGKILL, a lost host) leaves its peers blocked in their next collective: JAX's
coordination service notices only after its heartbeat timeout (100 s), then aborts them in C++ with a
stack trace. `PeerWatch` is a daemon thread that every second writes this process's beat into
`jax.distributed`'s key-value store and reads the others': a peer whose beat stands still for `timeout`
seconds, or a store that stops answering (process 0, which hosts it, is gone), ends this process with
one line saying so and how to resume (`sharding.exit_now`). A process that finishes normally marks its
beat done first, so a slower peer still writing its report is not stopped.
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import jax
from jax._src import distributed  # the coordination service's client: the only handle on its store

TIMEOUT_ENV = "MARLJAX_PEER_TIMEOUT"  # seconds a peer's beat may stand still (default `TIMEOUT`)
TIMEOUT = 60.0
DONE = "done"


class PeerWatch:
    """See the module docstring. `on_lost(reason)` must end the process (it runs on the watch thread).
    A context manager; leaving it normally or by one of the `normal` exceptions (a stop all processes
    agreed on) marks this process done."""

    def __init__(self, on_lost: Callable[[str], None], timeout: float | None = None, interval: float = 1.0,
                 normal: tuple[type[BaseException], ...] = (), client=None):
        self.on_lost, self.interval, self.normal = on_lost, interval, normal
        self.timeout = float(os.environ.get(TIMEOUT_ENV, TIMEOUT)) if timeout is None else timeout
        self.me, self.count = jax.process_index(), jax.process_count()
        self.client = client  # the store (`jax.distributed`'s client when None; a stand-in in tests)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="marljax-peer-watch", daemon=True)

    def __enter__(self) -> PeerWatch:
        if self.count > 1:
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        """Stop watching; on a normal exit mark this process done for the others."""
        self.stopped.set()
        if self.thread.is_alive():
            self.thread.join()
            if exc[0] is None or issubclass(exc[0], self.normal):
                self._client().key_value_set(_key(self.me), DONE, allow_overwrite=True)

    def _client(self):
        return self.client or distributed.global_state.client

    def _run(self) -> None:
        client = self._client()
        beat, seen = 0, {p: (None, time.monotonic()) for p in range(self.count) if p != self.me}
        while not self.stopped.wait(self.interval):
            beat += 1
            try:
                client.key_value_set(_key(self.me), str(beat), allow_overwrite=True)
                for p, (last, since) in seen.items():
                    value = _beat(client, p) if last != DONE else DONE
                    if value != last:
                        seen[p] = (value, time.monotonic())
                    elif value != DONE and time.monotonic() - since > self.timeout:
                        return self.on_lost(f"process {p} has not answered for {self.timeout:g} s (it died or "
                                            f"hangs; see its log)")
            except Exception as e:  # noqa: BLE001 - the store is gone with process 0: any error means that
                if self.stopped.is_set():
                    return
                return self.on_lost(f"the coordination service (process 0) stopped answering ({type(e).__name__}: "
                                    f"{str(e).splitlines()[0] if str(e) else ''}); process 0 died or hangs")


def _key(process: int) -> str:
    return f"marljax/core/peer_watch/{process}"


def _beat(client, process: int) -> str | None:
    """A peer's last beat; None before its first (its watch starts when it gets there)."""
    try:
        return client.key_value_try_get(_key(process))
    except jax.errors.JaxRuntimeError as e:
        if "NOT_FOUND" in str(e):
            return None
        raise
