"""One writer per run directory: an exclusive advisory lock on ``<run_dir>/run.lock``.

The lock is ``flock(LOCK_EX | LOCK_NB)`` on that file. The kernel releases it when the last
descriptor of the holder's open file closes, which includes the holder dying (``kill -9``, the
OOM killer): a lock never outlives its process, so there is no stale lock to break. The text
in the file (pid, host, since, command) only says who holds it, or held it:

- a second writer is refused with :class:`RunLockedError`, naming the holder;
- a holder that releases the lock empties the file, so a non-empty file found by a process
  that *gets* the lock was left by a holder that died without releasing it: that process takes
  over with a warning naming the dead holder;
- a child started by the holder (a study cell's trainer) shares the lock through an inherited
  descriptor named in ``$SORL_MEGATRON_RUN_LOCK_FD`` (:meth:`RunLock.child_env`), so it is not
  refused by its own parent, and the lock is held until both have exited.

flock works across processes of one host and, on Linux, on NFS (emulated with byte-range
locks); a run directory on a file system without locking raises the OS error at once.

The lock file is only ever a regular file of its own: it is opened with ``O_NOFOLLOW`` (a
symbolic link is never followed) and ``O_NONBLOCK`` (a FIFO cannot hang the open), and checked
with ``fstat`` before anything is read or written: a link (symbolic or hard: another name of a
file elsewhere), a directory, a FIFO or a device at ``run.lock`` is refused with
:class:`RunLockError` and left as it was, as is a run directory that is not a directory.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import stat
import sys
import time
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)

LOCK_NAME = "run.lock"
FD_ENV = "SORL_MEGATRON_RUN_LOCK_FD"  # a descriptor of the parent's locked file, inherited by a child


class RunLockError(RuntimeError):
    """The run directory or its lock file cannot be used (not a directory, a link, a FIFO ...);
    one line naming the path and what to do."""


class RunLockedError(RunLockError):
    """Another live process holds the run directory's lock; the message names it."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def _refuse_lock_file(path: Path, st: os.stat_result) -> None:
    """Raise :class:`RunLockError` unless ``st`` (not following links) is a regular file with one name."""
    if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
        return
    if stat.S_ISLNK(st.st_mode):
        what = f"a symbolic link (to {os.readlink(path)})"
    elif stat.S_ISREG(st.st_mode):
        what = f"a hard link (one of {st.st_nlink} names of one file)"
    else:
        what = _kind(st.st_mode)
    raise RunLockError(f"the run lock {path} is {what}: it must be a regular file of its own (a link is never "
                       "followed or written through); remove it and run again")


def _make_run_dir(run_dir: Path, what: str, kind_of_dir: str = "run directory") -> list[Path]:
    """Create ``run_dir`` (and its missing parents); returns those it created, itself first.
    A path on the way that is not a directory: :class:`RunLockError`."""
    created, missing = [], run_dir
    while not os.path.lexists(missing):
        created.append(missing)
        missing = missing.parent
    if not missing.is_dir():
        kind = "a file" if missing.is_file() else "not a directory"
        where = f"the {kind_of_dir}" if missing == run_dir else f"on the way to the {kind_of_dir} {run_dir}"
        hint = f"{what}=..., logging.dir=..." if what == "logging.run_name" else f"{what}=..."
        raise RunLockError(f"{missing} ({where}) is {kind}: pick another directory ({hint}) "
                           "or move it away")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RunLockError(f"cannot create the {kind_of_dir} {run_dir}: {err.strerror or err}") from None
    return created


def _holder_text(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, 4096).decode("utf-8", "replace").strip()


def describe_holder(text: str) -> str:
    """``pid 12 on host h since 2026-01-01 10:00:00`` from the lock file's ``key: value`` lines."""
    info = dict(line.split(": ", 1) for line in text.splitlines() if ": " in line)
    if not info.get("pid"):
        return "another process (it has not written its pid yet)"
    words = f"pid {info['pid']} on host {info.get('host', '?')} since {info.get('since', '?')}"
    return words + (f" ({info['command']})" if info.get("command") else "")


class RunLock:
    """A held lock; :meth:`release` (or leaving the ``with`` block) gives it back."""

    def __init__(self, path: Path, fd: int, inherited: bool, created: list[Path]):
        self.path, self.fd, self.inherited = path, fd, inherited
        self._created = created  # the directories acquire made, the run directory first

    def child_env(self) -> dict[str, str]:
        """Environment entries that let a child started with ``pass_fds=(lock.fd,)`` share this lock."""
        return {FD_ENV: str(self.fd)}

    def release(self) -> None:
        if self.fd < 0:
            return
        fd, self.fd = self.fd, -1
        if self.inherited:  # the parent's lock: it stays held by the parent, which empties the file
            return
        try:
            run_dir = self.path.parent
            if self._created and [p.name for p in run_dir.iterdir()] == [LOCK_NAME]:
                # nothing was written (an input error): leave no directory behind that acquire made.
                # Unlinked while held: a process that opened the file meanwhile finds it replaced.
                self.path.unlink()
                for directory in self._created:
                    try:
                        directory.rmdir()
                    except OSError:  # not empty (another run's), or already gone
                        break
            else:
                os.ftruncate(fd, 0)  # released normally: no holder to report
        finally:
            os.close(fd)  # closing the last descriptor releases the flock

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _inherited(path: Path) -> Optional[int]:
    """The descriptor named in ``$SORL_MEGATRON_RUN_LOCK_FD`` when it is this very lock file."""
    value = os.environ.get(FD_ENV, "")
    if not value.isdigit():
        return None
    fd = int(value)
    try:
        mine, theirs = os.fstat(fd), os.lstat(path)
    except OSError:
        return None
    return fd if (mine.st_dev, mine.st_ino) == (theirs.st_dev, theirs.st_ino) else None


def _open_lock_file(path: Path) -> int:
    """``path`` opened read-write (created if missing), never through a link, never blocking on
    a FIFO, and checked to be a regular file with one name before anything reads or writes it."""
    try:
        _refuse_lock_file(path, os.lstat(path))
    except FileNotFoundError:
        pass
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as err:  # a link or directory put there since the check (ELOOP, EISDIR ...)
        try:
            _refuse_lock_file(path, os.lstat(path))
        except FileNotFoundError:
            pass
        raise RunLockError(f"cannot open the run lock {path}: {err.strerror or err}") from None
    try:
        _refuse_lock_file(path, os.fstat(fd))
    except RunLockError:
        os.close(fd)
        raise
    os.set_blocking(fd, True)
    return fd


def acquire_run_lock(run_dir: str | os.PathLike, what: str = "logging.run_name",
                     kind: str = "run directory") -> RunLock:
    """Lock ``run_dir`` (created if missing) for this process, or raise :class:`RunLockedError`
    naming the holder. ``what`` names the setting that picks another directory, ``kind`` the
    directory (in the messages: a run's checkpoint directory is locked too)."""
    run_dir = Path(run_dir)
    created = _make_run_dir(run_dir, what, kind)
    path = run_dir / LOCK_NAME
    fd = _inherited(path)
    if fd is not None:
        return RunLock(path, fd, inherited=True, created=[])
    while True:
        _make_run_dir(run_dir, what, kind)  # a releasing holder may have just removed an empty one
        fd = _open_lock_file(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = _holder_text(fd) if err.errno in (errno.EAGAIN, errno.EACCES) else None
            os.close(fd)
            if holder is None:
                raise
            raise RunLockedError(
                f"{kind} {run_dir} is in use: {describe_holder(holder)} holds its lock ({path}). "
                f"Wait for that run to end (or stop it), or write to another directory ({what}=...)"
            ) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the file was removed by the holder that released it: lock the current one
    previous = _holder_text(fd)
    if previous:
        log.warning("run directory %s: taking over the lock left by %s, which ended without releasing it",
                    run_dir, describe_holder(previous))
    text = (f"pid: {os.getpid()}\nhost: {socket.gethostname()}\nsince: {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
            f"command: {' '.join(sys.argv)[:300]}\n")
    os.ftruncate(fd, 0)
    os.pwrite(fd, text.encode(), 0)
    return RunLock(path, fd, inherited=False, created=created)
