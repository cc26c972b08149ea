"""bm25s imports JAX at its own import when JAX is installed and runs a top-k, which on a CUDA
machine starts JAX's GPU backend and preallocates most of the GPU's memory (seen on an H100:
the trainer beside the retrieval server died with cudaErrorMemoryAllocation). JAX is absent
here, so a stand-in package named ``jax`` records being imported; the index must never import
it, and bm25s must still rank with numpy."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys
if sys.argv[1] == "bm25s":
    import bm25s  # what the index did before: bm25s reaches for jax
else:
    from sorl_megatron.retrieval.bm25 import BM25Index
    from sorl_megatron.retrieval.corpus import Passage
    index = BM25Index([Passage("0", "Paris is the capital of France"), Passage("1", "Berlin is in Germany")])
    print([p.id for p in index.search(["capital of France"], 2)[0]])
"""


def _run(tmp_path: Path, mode: str) -> tuple[subprocess.CompletedProcess, Path]:
    fake = tmp_path / "fake"
    (fake / "jax").mkdir(parents=True, exist_ok=True)
    marker = tmp_path / "jax_imported"
    (fake / "jax" / "__init__.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    (fake / "jax" / "lax.py").write_text("def top_k(x, k):\n    return x[:k], list(range(k))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(fake), str(ROOT)]))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, mode], env=env, capture_output=True, text=True,
                          timeout=120)
    return proc, marker


def test_the_stand_in_jax_is_what_bm25s_imports(tmp_path):
    proc, marker = _run(tmp_path, "bm25s")
    assert proc.returncode == 0, proc.stderr
    assert marker.exists()  # without the guard, bm25s imports (and on a GPU starts) JAX


def test_the_index_never_imports_jax_and_ranks_with_numpy(tmp_path):
    proc, marker = _run(tmp_path, "index")
    assert proc.returncode == 0, proc.stderr
    assert not marker.exists()
    assert proc.stdout.strip().splitlines()[-1] == "['0', '1']"
