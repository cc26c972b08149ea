"""Turns on the rollout servers, first come first served, over a torch ``Store``.

A server takes one weight update at a time, so the senders of a distributed sync (one per
pipeline stage, ``export.weight_sync_roles``) put their buckets on the wire in turns: each turn
is one bucket's broadcast (or the forming or leaving of a group). :class:`StoreMutex` hands the
turns out in the order they were asked for, a ticket lock over the training world's store:

- asking draws a ticket (``add`` on ``<key>/tickets``: atomic, so tickets are unique and
  ordered);
- ticket ``t`` is served once ``<key>/turn/<t>`` holds ``go``, which the holder of ``t - 1``
  writes when it lets go (ticket 0 is served at once). A waiter blocks in the store's ``wait``
  on that key (no polling: the store answers when the key is set), at most ``timeout_s``;
- a waiter that gives up writes ``gone`` into its own turn with ``compare_set`` (atomic against
  the holder writing ``go``): a holder that finds ``gone`` passes the turn on to the next ticket,
  and a waiter that finds ``go`` instead was served after all and takes its turn.

So a sender waits for at most the turns of those who asked before it: with ``n`` senders and
each turn at most ``h`` seconds, at most ``(n - 1) h`` (tests/weight_sync/test_turns.py runs 16,
64 and 128 senders against a real TCPStore). Each sync keys its turns apart (``key`` carries
the sync's number), so a failed sync leaves no ticket for the next.
"""

from __future__ import annotations

import contextlib
import time
from datetime import timedelta

GO, GONE = "go", "gone"


class StoreMutex:
    """Turns over ``store`` under ``key``, first come first served; ``timeout_s`` bounds each
    wait (``TimeoutError`` after it). ``lock()`` (the instance is called) is one turn."""

    def __init__(self, store, key: str, timeout_s: float):
        self.store, self.key, self.timeout_s = store, key, timeout_s

    def _turn(self, ticket: int) -> str:
        return f"{self.key}/turn/{ticket}"

    @contextlib.contextmanager
    def __call__(self):
        ticket = int(self.store.add(f"{self.key}/tickets", 1)) - 1
        if ticket > 0:
            self._wait(ticket)
        try:
            yield
        finally:
            self._pass_on(ticket + 1)

    def _wait(self, ticket: int) -> None:
        key, started = self._turn(ticket), time.monotonic()
        try:
            self.store.wait([key], timedelta(seconds=self.timeout_s))
        except Exception:  # the store's timeout (DistStoreError); the turn may come at this instant
            got = _text(self.store.compare_set(key, "", GONE))
            if got != GO:
                waited = time.monotonic() - started
                raise TimeoutError(f"waited {waited:.0f} s for the rollout servers (weight-sync turn {ticket}; "
                                   f"rollout.weight_sync.init_timeout_s = {self.timeout_s:g}): a sender "
                                   "before it held them longer") from None
        self.store.delete_key(key)  # served: nobody reads this turn again

    def _pass_on(self, ticket: int) -> None:
        """Serve ``ticket`` (or the first after it whose waiter is still there)."""
        while _text(self.store.compare_set(self._turn(ticket), "", GO)) == GONE:
            self.store.delete_key(self._turn(ticket))
            ticket += 1


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
