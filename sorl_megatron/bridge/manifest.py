"""A checkpoint directory's manifest: the size and sha256 of every file, written last.

``write_manifest`` runs once every rank has finished writing; ``verify_manifest`` runs before
anything in the directory is deserialized and names the first file that is missing,
unexpected, truncated or changed. Both are collective when a process group is initialized:
the ranks hash disjoint shares of the files (a large checkpoint is read once, in parallel)
and agree on one outcome, so every rank raises the same error.

The manifest detects damage (bit rot, truncation, partial copies, a save that never
finished, a stray writer); it is not a signature: whoever can rewrite the files can rewrite
the manifest too. Code execution is refused separately (safe_pickle.py).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

from ..common import comm
from .hf_config import CheckpointFileError

MANIFEST_FILE = "MANIFEST.json"
MANIFEST_FORMAT = "sorl_megatron.manifest/1"
_CHUNK = 8 << 20


class CheckpointDamagedError(CheckpointFileError):
    """A checkpoint file does not match its manifest (``path`` is that file)."""

    def __init__(self, path: str, what: str, others: int = 0):
        more = f" (and {others} more damaged file(s))" if others else ""
        super().__init__(f"{path}: {what}{more}")
        self.path = path


def _share(files: list[str], sizes: dict[str, int]) -> list[str]:
    """This rank's files: largest first, dealt round-robin (deterministic on every rank)."""
    rank, world = comm.rank(), comm.world_size()
    ordered = sorted(files, key=lambda f: (-sizes.get(f, 0), f))
    return ordered[rank::world]


def sha256_file(path: str) -> tuple[str, int]:
    h, n = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            n += len(chunk)
    return h.hexdigest(), n


def list_files(root: str) -> tuple[list[str], list[str]]:
    """(regular files, links or special files) under ``root`` as sorted relative posix paths,
    the manifest and its temporary file excluded."""
    files, odd = [], []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, root).replace(os.sep, "/")
            if os.path.islink(full) or not (os.path.isdir(full) or os.path.isfile(full)):
                odd.append(rel)
            elif name in filenames and rel not in (MANIFEST_FILE, MANIFEST_FILE + ".tmp"):
                files.append(rel)
        dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(dirpath, d))]
    return sorted(files), sorted(odd)


def write_manifest(root: str) -> None:
    """Hash every file under ``root`` and write ``root/MANIFEST.json`` atomically (rank 0).

    All ranks call it, after all of them finished writing into ``root``."""
    root = os.path.abspath(root)
    listing = comm.broadcast_object(list_files(root) if comm.rank() == 0 else None)
    files, odd = listing
    if odd:
        raise CheckpointFileError(f"{os.path.join(root, odd[0])}: links and special files are not checkpointed")
    sizes = {f: os.path.getsize(os.path.join(root, f)) for f in files} if comm.rank() == 0 else {}
    sizes = comm.broadcast_object(sizes)
    mine, error = {}, None
    try:
        mine = {f: sha256_file(os.path.join(root, f)) for f in _share(files, sizes)}
    except OSError as e:  # reported on every rank below, so that no rank waits for this one
        error = f"{e.filename}: cannot hash ({e.strerror})"
    parts = comm.all_gather_object((mine, error))
    errors = [err for _, err in parts if err]
    if errors:
        raise CheckpointFileError(errors[0])
    entries: dict[str, dict] = {}
    for part, _ in parts:
        entries.update({f: {"size": n, "sha256": digest} for f, (digest, n) in part.items()})
    if comm.rank() != 0:
        return
    body = json.dumps({"format": MANIFEST_FORMAT, "files": dict(sorted(entries.items()))}, indent=1)
    tmp = os.path.join(root, MANIFEST_FILE + ".tmp")
    with open(tmp, "w") as f:
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, MANIFEST_FILE))
    dir_fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _read_manifest(root: str) -> dict[str, dict]:
    path = os.path.join(root, MANIFEST_FILE)
    if not os.path.isfile(path):
        raise CheckpointDamagedError(
            path, "missing: the save did not finish, or the checkpoint predates manifests (not loadable)"
        )
    try:
        with open(path) as f:
            manifest = json.load(f)
        files = manifest["files"]
        if manifest.get("format") != MANIFEST_FORMAT or not isinstance(files, dict):
            raise ValueError(f"format {manifest.get('format')!r}, expected {MANIFEST_FORMAT!r}")
        for rel, entry in files.items():
            if not isinstance(entry, dict) or not isinstance(entry.get("size"), int) or not isinstance(
                entry.get("sha256"), str
            ):
                raise ValueError(f"bad entry for {rel!r}")
            if rel.startswith("/") or ".." in rel.split("/"):
                raise ValueError(f"path {rel!r} leaves the checkpoint directory")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointDamagedError(path, f"unreadable manifest ({type(e).__name__}: {e})") from None
    return files


def _local_problems(root: str) -> list[tuple[str, str]]:
    """(relative path, what is wrong) for this rank's view and share of the files."""
    try:
        expected = _read_manifest(root)
    except CheckpointDamagedError as e:
        return [(MANIFEST_FILE, str(e).split(": ", 1)[1])]
    files, odd = list_files(root)
    problems = [(rel, "a link or special file, not written by a save") for rel in odd]
    on_disk = set(files)
    problems += [(rel, "missing (listed in the manifest)") for rel in expected if rel not in on_disk]
    problems += [(rel, "not in the manifest (written after the save?)") for rel in files if rel not in expected]
    sizes = {}
    for rel in files:
        if rel in expected:
            try:
                size = os.path.getsize(os.path.join(root, rel))
            except OSError as e:
                problems.append((rel, f"unreadable ({e.strerror})"))
                continue
            if size != expected[rel]["size"]:
                want = expected[rel]["size"]
                problems.append((rel, f"{size} bytes, the manifest says {want} (truncated or damaged)"))
            else:
                sizes[rel] = size
    for rel in _share(sorted(sizes), sizes):
        try:
            digest, _ = sha256_file(os.path.join(root, rel))
        except OSError as e:  # a problem like any other: every rank must reach the gather
            problems.append((rel, f"unreadable ({e.strerror})"))
            continue
        if digest != expected[rel]["sha256"]:
            problems.append((rel, "sha256 differs from the manifest (damaged or modified after the save)"))
    return problems


_verified: dict[str, tuple] = {}  # root -> signature of the files that verified in this process


def _signature(root: str) -> Optional[tuple]:
    try:
        files, odd = list_files(root)
        stats = [os.stat(os.path.join(root, f)) for f in [*files, MANIFEST_FILE]]
    except OSError:
        return None
    return tuple(files), tuple(odd), tuple((s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns) for s in stats)


def verify_manifest(root: str) -> None:
    """Raise CheckpointDamagedError naming the first bad file under ``root``.

    All ranks call it. A directory that already verified in this process and whose files
    (inode, size, mtime, ctime) are unchanged on every rank is not hashed again."""
    root = os.path.abspath(root)
    sig = _signature(root)
    if all(comm.all_gather_object(sig is not None and _verified.get(root) == sig)):
        return
    _verified.pop(root, None)
    problems = sorted({p for part in comm.all_gather_object(_local_problems(root)) for p in part})
    if problems:
        rel, what = problems[0]
        raise CheckpointDamagedError(os.path.join(root, rel), what, others=len({r for r, _ in problems}) - 1)
    if sig is not None:
        _verified[root] = sig
