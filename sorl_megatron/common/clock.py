"""A thread-safe clock of the seconds during which something was going on."""

from __future__ import annotations

import threading
import time


class ActiveClock:
    """Seconds during which at least one holder was inside (``enter`` / ``exit``, nested, from
    any thread): the rollout servers' busy time as the trainer sees it (episodes in flight),
    or the time they were paused for weight syncs (``rollout.client.PauseClock``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active = 0
        self._since = 0.0
        self._total = 0.0

    def enter(self, exclusive: bool = False) -> None:
        """One more holder (``exclusive``: none if one is inside already)."""
        with self._lock:
            if exclusive and self._active:
                return
            if self._active == 0:
                self._since = time.monotonic()
            self._active += 1

    def exit(self) -> None:
        """One holder less (nothing when none is inside)."""
        with self._lock:
            if self._active == 0:
                return
            self._active -= 1
            if self._active == 0:
                self._total += time.monotonic() - self._since

    @property
    def active(self) -> bool:
        with self._lock:
            return self._active > 0

    def seconds(self) -> float:
        """Seconds with a holder inside since the clock was made (the current stretch included)."""
        with self._lock:
            return self._total + (time.monotonic() - self._since if self._active else 0.0)
