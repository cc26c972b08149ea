"""Is this Python the project's environment? A check the entry points make before their heavy
imports, so that a command run with the system ``python3`` (no torch), or outside the activated
virtual environment, says what to do instead of ending in a ``ModuleNotFoundError`` traceback.

Standard library only: it must work where nothing else is installed.
"""

from __future__ import annotations

import importlib.util
import os
import sys

# the packages every entry point needs at once (the rest of pyproject's dependencies come with them)
REQUIRED = ("torch", "omegaconf", "numpy", "transformers", "megatron")
HINT = "run: source .venv/bin/activate (or make setup)"


def missing_packages(names: tuple[str, ...] = REQUIRED) -> list[str]:
    """Those of ``names`` this interpreter cannot import (found without importing them)."""
    return [name for name in names if importlib.util.find_spec(name) is None]


def require_environment(program: str, names: tuple[str, ...] = REQUIRED) -> None:
    """Exit with status 2 and one line naming the missing packages and :data:`HINT` when
    ``names`` cannot be imported by this interpreter."""
    missing = missing_packages(names)
    if missing:
        print(f"{program}: {', '.join(missing)} cannot be imported by {sys.executable}, which is not the "
              f"project's virtual environment; {HINT}", file=sys.stderr)
        raise SystemExit(2)


def missing_path(path: "str | os.PathLike[str]") -> str:
    """``'PATH' does not exist``, and for a relative path the directory it was looked up in:
    every recipe and command-line path is relative to the working directory, so a command run
    from elsewhere than the repository names where it looked."""
    path = os.fspath(path)
    if os.path.isabs(path):
        return f"{path!r} does not exist"
    return f"{path!r} does not exist (relative to the working directory {os.getcwd()})"
