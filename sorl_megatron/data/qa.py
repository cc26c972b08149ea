"""Question-answering rows in the verl / Search-R1 parquet schema.

Columns: ``data_source`` (str), ``prompt`` (list of ``{"role", "content"}``), ``ability``
(str), ``reward_model`` (``{"style": "rule", "ground_truth": {"target": [str, ...]}}``),
``extra_info`` (``{"split": str, "index": int, ...}``). Files written by Search-R1's own
scripts are read as they are.
"""

from __future__ import annotations

import math
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


class DataError(ValueError):
    """A data file that cannot be used; each problem is reported as ``file:row: what is wrong``."""


def _targets(value: Any) -> list[str]:
    """The target strings of a ``reward_model`` cell; ValueError says what is wrong."""
    if not isinstance(value, dict):
        raise ValueError(f"column 'reward_model' must be a mapping with 'ground_truth', got {value!r:.100}")
    value = value.get("ground_truth", value)
    if isinstance(value, dict):
        if "target" not in value:
            raise ValueError(f"reward_model.ground_truth has no 'target' (keys: {sorted(value)})")
        value = value["target"]
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"the ground-truth target must be a string or a non-empty list of strings, got {value!r:.100}")
    out = []
    for i, v in enumerate(value):
        ok = isinstance(v, str) or (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v))
        if not ok:
            raise ValueError(f"target[{i}] must be a string, got {v!r:.100}")
        if not str(v).strip():
            # an empty target would reward an empty answer
            raise ValueError(f"target[{i}] is empty (targets: {list(value)!r:.100})")
        out.append(str(v))
    return out


def _prompt(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"column 'prompt' must be a non-empty list of chat messages, got {value!r:.100}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise ValueError(f"prompt[{i}] must be a {{'role', 'content'}} message, got {m!r:.100}")
        content, role = m.get("content"), m.get("role", "user")
        if not isinstance(content, str) or not content.strip():
            raise ValueError(f"prompt[{i}].content must be a non-empty string, got {content!r:.100}")
        if not isinstance(role, str) or not role:
            raise ValueError(f"prompt[{i}].role must be a non-empty string, got {role!r:.100}")
        out.append({"role": role, "content": content})
    return out


def _row(rec: dict[str, Any]) -> QARow:
    source = rec["data_source"]
    if not isinstance(source, str) or not source.strip():
        raise ValueError(f"data_source must be a non-empty string naming the data set, got {source!r:.100}")
    extra = rec.get("extra_info")
    if extra is not None and not isinstance(extra, dict):
        raise ValueError(f"extra_info must be a mapping (e.g. {{'split', 'index'}}) or null, got {extra!r:.100}")
    ability = rec.get("ability")
    return QARow(
        data_source=source,
        prompt=_prompt(rec["prompt"]),
        targets=_targets(rec["reward_model"]),
        ability="" if ability is None else str(ability),
        extra_info=dict(extra or {}),
    )


def read_parquet(path: str | Path, max_errors: int = 20) -> list[QARow]:
    """Rows of a verl / Search-R1 parquet file (an empty file gives ``[]``).

    Every row is checked: ``data_source`` a non-empty string, ``prompt`` a non-empty list of
    messages with non-empty string content, at least one non-empty target, ``extra_info`` a
    mapping or null. Problems raise :class:`DataError` listing up to ``max_errors`` of them as
    ``file:row: what is wrong`` (rows count from 0, as in pandas); a missing file raises
    FileNotFoundError.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file")
    if not path.is_file():
        raise DataError(f"{path}: not a file")
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as err:
        raise DataError(f"{path}: not a readable parquet file ({err})") from None
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise DataError(f"{path}: missing column(s) {missing} (has {table.column_names})")
    rows, errors, bad = [], [], 0
    for i, rec in enumerate(table.to_pylist()):
        try:
            rows.append(_row(rec))
        except ValueError as err:
            bad += 1
            if len(errors) < max_errors:
                errors.append(f"{path}:{i}: {err}")
    if bad:
        more = f"\n... and {bad - len(errors)} more" if bad > len(errors) else ""
        raise DataError(f"{bad} bad row(s) of {table.num_rows} in {path}:\n" + "\n".join(errors) + more)
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
