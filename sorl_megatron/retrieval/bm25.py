"""BM25 index (bm25s) over a Search-R1 JSONL corpus."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import bm25s
import numpy as np

from .corpus import Passage, read_corpus


class BM25Index:
    """Lexical retriever: English stop words removed, no stemming (no extra dependency)."""

    def __init__(self, passages: Sequence[Passage], k1: float = 1.5, b: float = 0.75):
        if not passages:
            raise ValueError("BM25Index needs at least one passage")
        self.passages = list(passages)
        self._bm25 = bm25s.BM25(k1=k1, b=b)
        tokens = bm25s.tokenize([p.contents for p in self.passages], stopwords="en", show_progress=False)
        self._bm25.index(tokens, show_progress=False)

    @classmethod
    def from_jsonl(cls, path: str | Path, **kwargs) -> "BM25Index":
        return cls(list(read_corpus(path)), **kwargs)

    def __len__(self) -> int:
        return len(self.passages)

    def search(self, queries: Sequence[str], topk: int) -> list[list[Passage]]:
        """Top-k passages per query, best first, each carrying its BM25 score.

        Queries whose words are all unknown, or all stop words, still get k passages (with
        score 0), as a dense retriever would; the caller sees the scores.
        """
        k = min(topk, len(self.passages))
        # Token strings (not ids) so bm25s maps them onto the index vocabulary.
        q_tokens = bm25s.tokenize(list(queries), stopwords="en", show_progress=False, return_ids=False)
        # bm25s maps a query with no tokens left (empty, or stop words only such as "is a") to
        # an id past its score matrix and raises; score those against nothing instead.
        known = [i for i, t in enumerate(q_tokens) if t]
        out = [[Passage(p.id, p.contents, 0.0) for p in self.passages[:k]] for _ in q_tokens]
        if known:
            ids, scores = self._bm25.retrieve([q_tokens[i] for i in known], k=k, show_progress=False, n_threads=1)
            ids, scores = np.asarray(ids), np.asarray(scores, dtype=np.float64)
            for i, row_ids, row_scores in zip(known, ids.tolist(), scores.tolist()):
                out[i] = [
                    Passage(self.passages[j].id, self.passages[j].contents, float(s))
                    for j, s in zip(row_ids, row_scores)
                ]
        return out
