"""Data: verl / Search-R1 parquet rows (``qa``), a synthetic knowledge base with gold plans
(``synthetic``, ``gold``), an offline BPE tokenizer (``tokenizer``) and tiny random HF models
(``tiny_model``); nothing is downloaded."""

from .qa import SEARCH_INSTRUCTION, DataError, QARow, encode_prompt, make_row, read_parquet, write_parquet

__all__ = ["SEARCH_INSTRUCTION", "DataError", "QARow", "encode_prompt", "make_row", "read_parquet", "write_parquet"]
