"""Search-R1 retrieval: corpus format, BM25 index, ``/retrieve`` server and client."""

from .bm25 import BM25Index
from .client import RetrievalClient
from .corpus import Passage, format_passages, read_corpus

__all__ = ["BM25Index", "Passage", "RetrievalClient", "format_passages", "read_corpus"]
