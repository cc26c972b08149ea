"""Shared fixtures: tiny HF checkpoints and the two grouped worker launches.

Megatron is only imported in subprocesses (worker.py, the CLI): each launch costs ~10 s,
so every launch runs many checks and the tests assert on its JSON results.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .cases import MP_CASES, SINGLE_CASES
from .harness import run_worker
from .tiny_models import CONFIGS, save_tiny_model


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hf_models")
    for i, kind in enumerate(CONFIGS):
        save_tiny_model(kind, str(root / kind), seed=i)
    return root


@pytest.fixture(scope="session")
def work_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("megatron_work")


@pytest.fixture(scope="session")
def mp_results(models_dir, work_dir):
    return run_worker(MP_CASES, models_dir, work_dir, nproc=2, name="mp")


@pytest.fixture(scope="session")
def single_results(models_dir, work_dir, mp_results):  # after mp: it loads mp's checkpoints
    return run_worker(SINGLE_CASES, models_dir, work_dir, nproc=1, name="single")



