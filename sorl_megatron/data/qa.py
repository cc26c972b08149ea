"""Question-answering rows in the verl / Search-R1 parquet schema.

Columns: ``data_source`` (str), ``prompt`` (list of ``{"role", "content"}``), ``ability``
(str), ``reward_model`` (``{"style": "rule", "ground_truth": {"target": [str, ...]}}``),
``extra_info`` (``{"split": str, "index": int, ...}``). Files written by Search-R1's own
scripts are read as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

REQUIRED_COLUMNS = ("data_source", "prompt", "reward_model")

# The search-agent instruction (same protocol as Search-R1's prompt; wording is ours).
SEARCH_INSTRUCTION = (
    "Answer the given question. Think step by step inside <think> and </think> every time you "
    "get new information. If you lack knowledge, search by writing <search> query </search>; "
    "the top results come back between <information> and </information>. You may search as "
    "often as you need. When you know the answer, write it inside <answer> and </answer> "
    "without explanation, for example <answer> Beijing </answer>. Question: {question}\n"
)


@dataclass
class QARow:
    data_source: str
    prompt: list[dict[str, str]]
    targets: list[str]
    ability: str = "fact-reasoning"
    extra_info: dict[str, Any] = field(default_factory=dict)

    @property
    def question(self) -> str:
        return str(self.extra_info.get("question", self.prompt[-1]["content"]))

    def to_record(self) -> dict[str, Any]:
        return {
            "data_source": self.data_source,
            "prompt": self.prompt,
            "ability": self.ability,
            "reward_model": {"style": "rule", "ground_truth": {"target": list(self.targets)}},
            "extra_info": self.extra_info,
        }


def make_row(question: str, targets: Sequence[str], data_source: str, split: str, index: int, **extra: Any) -> QARow:
    prompt = [{"role": "user", "content": SEARCH_INSTRUCTION.format(question=question.strip())}]
    info = {"split": split, "index": index, "question": question, **extra}
    return QARow(data_source=data_source, prompt=prompt, targets=list(targets), extra_info=info)


def _targets(value: Any, where: str) -> list[str]:
    if isinstance(value, dict):
        value = value.get("ground_truth", value)
    if isinstance(value, dict):
        if "target" not in value:
            raise ValueError(f"{where}: reward_model.ground_truth has no 'target' (keys: {sorted(value)})")
        value = value["target"]
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, (str, int, float)) for v in value):
        return [str(v) for v in value]
    raise ValueError(f"{where}: ground-truth target must be a string or non-empty list of strings, got {value!r}")


def read_parquet(path: str | Path) -> list[QARow]:
    """Rows of a verl / Search-R1 parquet file; errors name the file, row and column."""
    table = pq.read_table(path)
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise ValueError(f"{path}: missing column(s) {missing} (has {table.column_names})")
    rows = []
    for i, rec in enumerate(table.to_pylist()):
        where = f"{path} row {i}"
        prompt = rec["prompt"]
        if (
            not isinstance(prompt, list)
            or not prompt
            or not all(isinstance(m, dict) and "content" in m for m in prompt)
        ):
            raise ValueError(f"{where}: column 'prompt' must be a non-empty list of chat messages")
        rows.append(
            QARow(
                data_source=str(rec["data_source"]),
                prompt=[{"role": str(m.get("role", "user")), "content": str(m["content"])} for m in prompt],
                targets=_targets(rec["reward_model"], where),
                ability=str(rec.get("ability") or ""),
                extra_info=dict(rec.get("extra_info") or {}),
            )
        )
    return rows


def write_parquet(rows: Sequence[QARow], path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist([r.to_record() for r in rows]), out)
    return out


def encode_prompt(tokenizer: Any, row: QARow) -> list[int]:
    """Chat-templated prompt ids, ending with the assistant header."""
    ids = tokenizer.apply_chat_template(row.prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids)
