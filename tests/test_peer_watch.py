"""`PeerWatch` (marljax/core/peer_watch.py) against a stand-in for jax.distributed's key-value store: a silent
peer, a store that stops answering, and peers that finished or beat on stay quiet. The multi-process
runs themselves are in tests/test_multihost.py (slow)."""
import threading
import time

import jax
import pytest

from marljax.core import peer_watch
from marljax.core.peer_watch import PeerWatch


class Store:
    """The store of a run of `count` processes whose other peers beat on their own (`beating`) or not."""

    def __init__(self, beating: set[int], fail_after: float | None = None):
        self.values, self.beating, self.fail_at = {}, beating, None if fail_after is None else time.time() + fail_after
        self.beats = 0

    def key_value_set(self, key, value, allow_overwrite=False):
        self._check()
        self.values[key] = value

    def key_value_try_get(self, key):
        self._check()
        self.beats += 1
        process = int(key.rsplit("/", 1)[1])
        if process in self.beating:
            return str(self.beats)  # a fresh beat on every read
        if key not in self.values:
            raise jax.errors.JaxRuntimeError(f"NOT_FOUND: Config key {key} not found.")
        return self.values[key]

    def _check(self):
        if self.fail_at is not None and time.time() > self.fail_at:
            raise jax.errors.JaxRuntimeError("UNAVAILABLE: failed to connect to all addresses")


def _watch(store, count: int, seconds: float) -> list[str]:
    """Run a watch as process 0 of `count` for up to `seconds`; the reasons it gave for stopping."""
    lost, done = [], threading.Event()

    def on_lost(reason):
        lost.append(reason)
        done.set()
    watch = PeerWatch(on_lost, timeout=0.3, interval=0.02, client=store)
    watch.me, watch.count = 0, count
    with watch:
        done.wait(seconds)
    return lost


def test_a_silent_peer_stops_this_process_and_a_beating_one_does_not():
    store = Store(beating={1})
    store.values[peer_watch._key(2)] = "7"  # process 2 beat once, then went silent
    lost = _watch(store, 3, 5.0)
    assert lost == ["process 2 has not answered for 0.3 s (it died or hangs; see its log)"]
    assert _watch(Store(beating={1, 2}), 3, 1.0) == []


def test_a_peer_that_finished_and_one_not_yet_started_are_waited_for():
    store = Store(beating=set())
    store.values[peer_watch._key(1)] = peer_watch.DONE
    assert _watch(store, 2, 1.0) == []  # done: never lost
    lost = _watch(Store(beating=set()), 2, 5.0)  # never started: lost once the timeout passes
    assert lost and lost[0].startswith("process 1 has not answered")


def test_a_store_that_stops_answering_means_process_0_is_gone():
    lost = _watch(Store(beating={1}, fail_after=0.2), 2, 5.0)
    assert len(lost) == 1 and lost[0].startswith("the coordination service (process 0) stopped answering "
                                                 "(JaxRuntimeError: UNAVAILABLE"), lost


def test_leaving_normally_marks_this_process_done():
    store = Store(beating={1})
    watch = PeerWatch(lambda reason: pytest.fail(reason), timeout=5, interval=0.02, client=store)
    watch.me, watch.count = 0, 2
    with watch:
        time.sleep(0.1)
    assert store.values[peer_watch._key(0)] == peer_watch.DONE
