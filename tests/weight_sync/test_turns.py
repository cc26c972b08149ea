"""The senders' turns on the rollout servers at scale: the real lock (``StoreMutex``, as the
distributed transport makes it) over a real TCPStore, 16, 64 and 128 senders (the expert owners
of the Qwen3-30B-A3B, Qwen3-235B-A22B and DeepSeek-V3 recipes, each of which formed its own group
before issue 45), each a thread with its own store client taking 4 turns of 0.1 s back to back
(a sender whose buckets need no gathers between them).

First come first served, a sender waits for at most the turns of those who asked before it:
at most n - 1 turns pass while it waits (counted, so the bound does not depend on the machine's
speed; one more for the instant between reading the count and asking), i.e. (n - 1) x 0.1 s plus
the store's hand-overs. A wall-clock bound with room for those hand-overs on a loaded machine is
also the lock's timeout here, as ``rollout.weight_sync.init_timeout_s`` is in a run. A lock that
lets one sender take turn after turn while others wait fails both."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from sorl_megatron.weight_sync.distributed import StoreMutex

pytestmark = pytest.mark.slow

HOLD_S = 0.1
TURNS = 4


def bound_s(senders: int) -> float:
    """The longest a first-come-first-served sender waits: (n - 1) turns, with room for each
    hand-over (a store round trip and a thread waking, slow on a loaded machine)."""
    return (senders - 1) * HOLD_S * 2 + 5.0


def run_senders(senders: int, timeout_s: float):
    """(waits in seconds, turns that passed during each wait, errors, holders in order)."""
    master = TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    waits: list[float] = []
    passed: list[int] = []
    errors: list[BaseException] = []
    holders: list[int] = []  # who held the servers, in order
    inside = threading.Semaphore(1)
    ready = threading.Barrier(senders)

    def sender(i: int) -> None:
        client = TCPStore("127.0.0.1", master.port, 1, is_master=False, timeout=timedelta(seconds=60))
        lock = StoreMutex(client, "sorl_wsync_lock/1", timeout_s)
        ready.wait()
        try:
            for _ in range(TURNS):
                asked, before = time.monotonic(), len(holders)
                with lock():
                    waits.append(time.monotonic() - asked)
                    passed.append(len(holders) - before)
                    assert inside.acquire(blocking=False), "two senders hold the servers at once"
                    holders.append(i)
                    time.sleep(HOLD_S)
                    inside.release()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=sender, args=(i,), daemon=True) for i in range(senders)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s * TURNS + 120)
    assert not any(t.is_alive() for t in threads), "a sender never finished"
    return waits, passed, errors, holders


@pytest.mark.parametrize("senders", [16, 64, 128])
def test_turns_are_first_come_first_served_and_every_wait_is_bounded(senders):
    bound = bound_s(senders)
    waits, passed, errors, holders = run_senders(senders, timeout_s=bound)
    most = max(passed, default=0)
    assert most <= senders, f"{most} turns went to others while one sender waited ({senders} senders)"
    assert errors == [], f"{len(errors)} senders failed, first: {errors[0]!r}"
    assert len(holders) == senders * TURNS
    longest = max(waits)
    assert longest <= bound, f"a sender waited {longest:.1f} s for its turn (bound {bound:.1f} s)"
    # nobody takes two turns in a row while others wait for one (before the last round, where
    # the others may have finished)
    again = [k for k in range(1, len(holders) - senders) if holders[k] == holders[k - 1]]
    assert again == [], f"{len(again)} turns went to the sender that had just held the servers"
