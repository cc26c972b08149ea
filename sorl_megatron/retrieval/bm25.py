"""BM25 index (bm25s) over a Search-R1 JSONL corpus."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from .corpus import Passage, read_corpus


def _import_bm25s_without_jax():
    """bm25s imports JAX when it is installed and runs a top-k at import: on a CUDA machine that
    starts JAX's GPU backend, which preallocates 75% of the GPU's memory in the retrieval server
    (seen on an H100: the trainer beside it died with cudaErrorMemoryAllocation, or a second
    such process failed to start). Hide JAX from that import (unless this process already
    imported it) so bm25s selects its top-k with numpy, as it does where JAX is absent: the
    same passages and order on every machine."""
    if "bm25s" in sys.modules or "jax" in sys.modules:
        import bm25s
        return bm25s
    sys.modules["jax"] = None  # `import jax.lax` now raises ImportError
    try:
        import bm25s
    finally:
        del sys.modules["jax"]
    return bm25s


bm25s = _import_bm25s_without_jax()

STOPWORDS = "en"  # bm25s's English list; its tokenizer also drops one-character words
NO_TERMS = (
    "no passage has a word BM25 can index (every passage holds only English stop words, one-character words "
    "or punctuation): every query would score 0 against every passage"
)


def check_bm25_params(k1: float, b: float) -> None:
    """BM25's parameters, else a ValueError naming the flag: NaN or a negative k1, or b outside
    [0, 1], makes every score NaN or meaningless."""
    if not (isinstance(k1, (int, float)) and math.isfinite(k1) and k1 >= 0):
        raise ValueError(f"--bm25-k1 must be a finite number >= 0, got {k1}")
    if not (isinstance(b, (int, float)) and 0 <= b <= 1):
        raise ValueError(f"--bm25-b must be in [0, 1], got {b}")


def has_index_terms(texts: Iterable[str]) -> bool:
    """Whether any of ``texts`` keeps a word after the index's tokenization (stops at the
    first that does, so a real corpus is decided by its first passages)."""
    return any(bm25s.tokenize([t], stopwords=STOPWORDS, show_progress=False, return_ids=False)[0] for t in texts)


class BM25Index:
    """Lexical retriever: English stop words removed, no stemming (no extra dependency)."""

    def __init__(self, passages: Sequence[Passage], k1: float = 1.5, b: float = 0.75):
        if not passages:
            raise ValueError("BM25Index needs at least one passage")
        check_bm25_params(k1, b)
        self.passages = list(passages)
        self._bm25 = bm25s.BM25(k1=k1, b=b)
        tokens = bm25s.tokenize([p.contents for p in self.passages], stopwords=STOPWORDS, show_progress=False)
        if not tokens.vocab:  # bm25s would fail with "max() arg is an empty sequence"
            raise ValueError(NO_TERMS)
        self._bm25.index(tokens, show_progress=False)

    @classmethod
    def from_jsonl(cls, path: str | Path, **kwargs) -> "BM25Index":
        """The index of a JSONL corpus; a ValueError naming the file when it cannot be indexed."""
        passages = list(read_corpus(path))
        if not passages:
            raise ValueError(f"{path}: the corpus has no passages")
        try:
            return cls(passages, **kwargs)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None

    def __len__(self) -> int:
        return len(self.passages)

    def search(self, queries: Sequence[str], topk: int) -> list[list[Passage]]:
        """Top-k passages per query, best first, each carrying its BM25 score.

        Queries whose words are all unknown, or all stop words, still get k passages (with
        score 0), as a dense retriever would; the caller sees the scores.
        """
        k = min(topk, len(self.passages))
        # Token strings (not ids) so bm25s maps them onto the index vocabulary.
        q_tokens = bm25s.tokenize(list(queries), stopwords=STOPWORDS, show_progress=False, return_ids=False)
        # bm25s maps a query with no tokens left (empty, or stop words only such as "is a") to
        # an id past its score matrix and raises; score those against nothing instead.
        known = [i for i, t in enumerate(q_tokens) if t]
        out = [[Passage(p.id, p.contents, 0.0) for p in self.passages[:k]] for _ in q_tokens]
        if known:
            ids, scores = self._bm25.retrieve([q_tokens[i] for i in known], k=k, show_progress=False, n_threads=1,
                                               backend_selection="numpy")
            ids, scores = np.asarray(ids), np.asarray(scores, dtype=np.float64)
            if not np.isfinite(scores).all():  # never NaN into JSON (check_bm25_params keeps this away)
                raise ValueError(f"BM25 scores are not finite (k1={self._bm25.k1}, b={self._bm25.b})")
            for i, row_ids, row_scores in zip(known, ids.tolist(), scores.tolist()):
                out[i] = [
                    Passage(self.passages[j].id, self.passages[j].contents, float(s))
                    for j, s in zip(row_ids, row_scores)
                ]
        return out
