"""The checkpoint manifest: written last, verified before loading, names the bad file."""

from __future__ import annotations

import json
import os

import pytest

from sorl_megatron.bridge import CheckpointFileError, manifest
from sorl_megatron.bridge.manifest import MANIFEST_FILE, CheckpointDamagedError, verify_manifest, write_manifest


@pytest.fixture
def ckpt(tmp_path):
    d = tmp_path / "ck"
    (d / "model").mkdir(parents=True)
    (d / "model" / "__0_0.distcp").write_bytes(os.urandom(50_000))
    (d / "model" / ".metadata").write_bytes(b"meta")
    (d / "trainer.json").write_text("{}")
    (d / "empty").write_bytes(b"")
    write_manifest(str(d))
    return d


def test_manifest_lists_every_file_with_size_and_sha256(ckpt):
    m = json.loads((ckpt / MANIFEST_FILE).read_text())
    assert sorted(m["files"]) == ["empty", "model/.metadata", "model/__0_0.distcp", "trainer.json"]
    assert m["files"]["model/__0_0.distcp"]["size"] == 50_000
    assert not (ckpt / (MANIFEST_FILE + ".tmp")).exists()
    verify_manifest(str(ckpt))


def _damaged(ckpt, rel) -> str:
    with pytest.raises(CheckpointDamagedError) as e:
        verify_manifest(str(ckpt))
    assert str(e.value).startswith(f"{ckpt / rel}: "), str(e.value)
    assert e.value.path == str(ckpt / rel)
    return str(e.value)


def test_flipped_bit_truncation_missing_and_extra_files(ckpt):
    shard = ckpt / "model" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[12345] ^= 1
    shard.write_bytes(data)
    assert "sha256 differs" in _damaged(ckpt, "model/__0_0.distcp")
    shard.write_bytes(data[:100])
    assert "100 bytes, the manifest says 50000" in _damaged(ckpt, "model/__0_0.distcp")
    shard.unlink()
    assert "missing" in _damaged(ckpt, "model/__0_0.distcp")


def test_extra_files_links_and_several_problems(ckpt):
    (ckpt / "model" / "__1_0.distcp").write_bytes(b"x")
    assert "not in the manifest" in _damaged(ckpt, "model/__1_0.distcp")
    (ckpt / "model" / "__1_0.distcp").unlink()
    (ckpt / "trainer.json").write_text("{ }")  # a different size
    os.symlink("/etc/passwd", ckpt / "model" / "a_link")
    err = _damaged(ckpt, "model/a_link")
    assert "link" in err and "and 1 more damaged file" in err


@pytest.mark.parametrize(
    "body,needle",
    [
        (None, "missing: the save did not finish"),
        ("{not json", "unreadable manifest"),
        (json.dumps({"format": "other", "files": {}}), "unreadable manifest"),
        (json.dumps({"format": manifest.MANIFEST_FORMAT, "files": {"../x": {"size": 1, "sha256": "0"}}}), "leaves"),
    ],
)
def test_missing_or_bad_manifest(ckpt, body, needle):
    if body is None:
        (ckpt / MANIFEST_FILE).unlink()
    else:
        (ckpt / MANIFEST_FILE).write_text(body)
    assert needle in _damaged(ckpt, MANIFEST_FILE)


def test_verified_directory_is_not_hashed_again_until_a_file_changes(ckpt, monkeypatch):
    calls = []
    real = manifest.sha256_file
    monkeypatch.setattr(manifest, "sha256_file", lambda p: calls.append(p) or real(p))
    verify_manifest(str(ckpt))
    first = len(calls)
    verify_manifest(str(ckpt))
    assert first == 4 and len(calls) == first  # the second check is a stat of each file
    meta = ckpt / "model" / ".metadata"
    stat = meta.stat()
    meta.write_bytes(b"mETA")  # same size; a later mtime (set explicitly: some file systems tick coarsely)
    os.utime(meta, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert "sha256 differs" in _damaged(ckpt, "model/.metadata")


def test_unreadable_file_is_a_named_problem_not_a_crash(ckpt, monkeypatch):
    """As root (here) chmod cannot make a file unreadable: the read error is simulated. A
    raise would leave the other ranks waiting in the gather; a problem is reported by all."""
    real = manifest.sha256_file

    def unreadable(path):
        if path.endswith("__0_0.distcp"):
            raise PermissionError(13, "Permission denied", path)
        return real(path)

    monkeypatch.setattr(manifest, "sha256_file", unreadable)
    assert "unreadable (Permission denied)" in _damaged(ckpt, "model/__0_0.distcp")
    with pytest.raises(CheckpointFileError, match=r"__0_0\.distcp: cannot hash \(Permission denied\)"):
        write_manifest(str(ckpt))
