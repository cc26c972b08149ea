"""The run's input files, checked before any server, engine or run directory exists.

``validate_inputs(cfg)`` reads every file the recipe names: ``data.train`` and ``data.val``
(every row against the verl / Search-R1 schema, each ``data_source`` against the reward
registry, each row's targets against its metric), ``retrieval.corpus`` when the embedded
retrieval server will serve it (every line: UTF-8, JSON, ``contents``; some passage must keep a
word after the index's stop-word removal, else the server cannot build its index),
``checkpoint.resume`` when it names a directory, and the run directory's ``config.yaml`` (a run
with other defining settings is refused). Problems raise :class:`InputError` naming
the key and the file, and each bad row or line as ``file:row: what is wrong``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ...common.environment import missing_path
from ...common.typed_config import ConfigError
from ...data.qa import DataError, QARow, read_parquet
from ...retrieval.bm25 import NO_TERMS, has_index_terms
from ...retrieval.corpus import read_corpus
from ...rewards.qa import choice_letter, normalize_answer
from ...rewards.registry import DEFAULT_SOURCES, RewardRegistry
from .config import TrainConfig
from .run_settings import run_settings_problem

MAX_LISTED = 20  # bad rows named in one error


class InputError(ConfigError):
    """An input file (data, corpus, checkpoint) that cannot be used; the message names the key and file."""


@dataclass(frozen=True)
class InputSummary:
    """The checked rows (the run trains on these: each file is read once) and the corpus size."""

    train: list[QARow]
    val: list[QARow]
    passages: int | None  # None: not checked (an external retrieval.url, or not this rank's job)

    @property
    def train_rows(self) -> int:
        return len(self.train)

    @property
    def val_rows(self) -> int:
        return len(self.val)


def validate_inputs(
    cfg: TrainConfig, check_corpus: bool = True, rewards: Optional[RewardRegistry] = None
) -> InputSummary:
    """Check the recipe's input files; return what they hold.

    ``check_corpus=False`` skips the full scan of ``retrieval.corpus`` (only the rank that
    starts the embedded retrieval server needs it; the file's existence is still checked).
    ``rewards``: the registry the run scores with (default: the recipe's ``reward`` group).
    """
    registry = rewards or RewardRegistry(metric_override=cfg.reward.metric, format_weight=cfg.reward.format_weight)
    train = _rows("data.train", cfg.data.train, registry)
    if not train:
        raise InputError(f"data.train: {cfg.data.train} has no rows: there is nothing to train on")
    val = _rows("data.val", cfg.data.val, registry) if cfg.data.val else []
    if cfg.data.val and not val:
        raise InputError(f"data.val: {cfg.data.val} has no rows (set data.val= to run without validation)")
    passages = None
    if not cfg.retrieval.url:
        _file("retrieval.corpus", cfg.retrieval.corpus)
        if check_corpus:
            passages = _corpus(cfg.retrieval.corpus)
    check_resume_dir(cfg)
    return InputSummary(train, val, passages)


def load_tokenizer(path: str):
    """The model's tokenizer (transformers, never the checkpoint's own code: no
    ``trust_remote_code``); an InputError naming ``model.path`` when transformers cannot build
    one, e.g. a tiktoken tokenizer shipped as custom code (Moonlight): convert it to a
    ``tokenizer.json`` first (docs/how-to/convert.md)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, ImportError) as err:
        raise InputError(
            f"model.path: {path} has no tokenizer transformers can load without running the model's own "
            f"code (this package never sets trust_remote_code); ship a tokenizer.json (fast tokenizer) in that "
            f"directory ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
        ) from err


def check_resume_dir(cfg: TrainConfig) -> None:
    """``checkpoint.resume``, when it names a directory, is one, and the run directory holds no
    run with other defining settings (trainer/recipe/run_settings.py); InputError otherwise."""
    resume = cfg.checkpoint.resume
    if resume not in ("auto", "none") and not Path(resume).is_dir():
        raise InputError(f"checkpoint.resume: {resume} is not a directory (auto, none or a checkpoint directory)")
    problem = run_settings_problem(cfg)
    if problem:
        raise InputError(problem)


def _file(key: str, path: str) -> Path:
    p = Path(path)
    if not p.exists():
        raise InputError(f"{key}: {missing_path(path)}")
    if not p.is_file():
        raise InputError(f"{key}: {path} is not a file")
    if not os.access(p, os.R_OK):
        raise InputError(f"{key}: {path} is not readable")
    if p.stat().st_size == 0:
        raise InputError(f"{key}: {path} is empty")
    return p


def _rows(key: str, path: str, registry: RewardRegistry) -> list[QARow]:
    _file(key, path)
    try:
        rows = read_parquet(path, max_errors=MAX_LISTED)
    except (DataError, FileNotFoundError) as err:
        raise InputError(f"{key}: {err}") from None
    listed = [f"{path}:{i}: {e}" for i, row in enumerate(rows) if (e := _reward_problem(row, registry))]
    if listed:
        more = f"\n... and {len(listed) - MAX_LISTED} more" if len(listed) > MAX_LISTED else ""
        raise InputError(
            f"{key}: {len(listed)} row(s) of {path} cannot be scored:\n" + "\n".join(listed[:MAX_LISTED]) + more
        )
    return rows


def _reward_problem(row: QARow, registry: RewardRegistry) -> str | None:
    """Why the row's reward cannot work, or None: an unknown ``data_source`` (the trainer
    would otherwise score it with some default metric), or targets its metric can never
    match (every target empty after SQuAD normalization, or no option letter)."""
    try:
        registry.get(row.data_source)
    except KeyError:
        return f"data_source {row.data_source!r} has no reward (known: {', '.join(registry.known())})"
    if DEFAULT_SOURCES.get(row.data_source) == "mc":
        if not any(choice_letter(t) for t in row.targets):
            return f"no option letter in the targets {row.targets!r:.100} of a multiple-choice source"
    elif not any(normalize_answer(t) for t in row.targets):
        return f"every target is empty after answer normalization ({row.targets!r:.100}): the row can never score"
    return None


def _corpus(path: str) -> int:
    count, indexable = 0, False
    try:
        for passage in read_corpus(path):
            count += 1
            # tokenized until the first passage with a word (a real corpus: its first)
            indexable = indexable or has_index_terms([passage.contents])
    except ValueError as err:  # names file and line
        raise InputError(f"retrieval.corpus: {err}") from None
    if count == 0:
        raise InputError(f"retrieval.corpus: {path} has no passages")
    if not indexable:
        raise InputError(f"retrieval.corpus: {path}: {NO_TERMS}")
    return count
