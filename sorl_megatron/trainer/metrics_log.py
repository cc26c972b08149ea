"""Run logging: JSONL metrics per step, TensorBoard scalars, console progress with ETA.

Only rank 0 writes. Each JSONL line is ``{"step": int, "time": float, <metric>: float, ...}``
with the metric names the losses and engine produce (``actor/clip_frac``,
``actor/clip_bias/norm``, ``rollout/reward``, ``val/em``, ``time/rollout`` ...), which
``tools/plot.py`` reads back.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any, Mapping, Optional

from tqdm import tqdm

from ..algorithms.diagnostics import Histogram


def show_trainer_log(level: int = logging.INFO) -> None:
    """Print the trainer's own log records (PVPO counts, warnings) on the console, leaving
    other libraries' loggers as they are; idempotent (entry points call it, not the library)."""
    logger = logging.getLogger("sorl_megatron")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(name)s] %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(level)


class MetricsLogger:
    """Append-only JSONL + optional TensorBoard + a progress line per step."""

    def __init__(
        self,
        run_dir: str | Path,
        total_steps: int,
        tensorboard: bool = True,
        progress: str = "tqdm",
        enabled: bool = True,
        start_step: int = 0,
        name: str = "rl",  # the progress line's label
    ) -> None:
        self.enabled = enabled
        self.name = name
        self.total_steps = total_steps
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self._tb = None
        self._bar = None
        self._t0 = time.monotonic()
        self._start_step = start_step
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if start_step == 0 and self.path.exists():
            self.path.unlink()  # a fresh run; resumed runs append
        elif start_step > 0:
            _truncate_after(self.path, start_step)  # drop steps logged after the checkpoint
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter  # slow import: only runs that log to TensorBoard

                self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
            except ImportError:  # tensorboard is a declared dependency; tolerate its absence
                self._tb = None
        if progress == "tqdm":
                self._bar = tqdm(total=total_steps, initial=start_step, desc=name, unit="step", dynamic_ncols=True)
        self._progress = progress

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record one step's metrics (tensors and numbers; non-finite values kept as null)."""
        if not self.enabled:
            return
        row: dict[str, Any] = {"step": int(step), "time": round(time.monotonic() - self._t0, 3)}
        for key, value in metrics.items():
            number = _as_float(value)
            if number is not None:
                row[key] = number if math.isfinite(number) else None
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for key, value in row.items():
                if key not in ("step", "time") and value is not None:
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()
        self._show(step, row)

    def log_histogram(self, step: int, tag: str, hist: Histogram) -> None:
        """One TensorBoard histogram (bin edges and counts with the exact min, max and sums);
        skipped without TensorBoard and when empty. The open last bin ends at the maximum."""
        if not self.enabled or self._tb is None or hist.num == 0:
            return
        limits = hist.edges[1:].tolist()
        limits[-1] = max(float(hist.maximum), limits[-2])
        self._tb.add_histogram_raw(
            tag, min=float(hist.minimum), max=float(hist.maximum), num=int(hist.num), sum=float(hist.total),
            sum_squares=float(hist.total_squares), bucket_limits=limits, bucket_counts=hist.counts.tolist(),
            global_step=step,
        )
        self._tb.flush()

    def _show(self, step: int, row: Mapping[str, Any]) -> None:
        keys = [
            k
            for k in (
                "sft/nll",
                "rollout/reward",
                "val/em",
                "actor/clip_frac",
                "actor/clip_bias/norm",
                "actor/grad_norm",
            )
            if row.get(k) is not None
        ]
        summary = " ".join(f"{k.split('/', 1)[-1]}={row[k]:.4g}" for k in keys)
        if self._bar is not None:
            self._bar.set_postfix_str(summary, refresh=False)
            self._bar.update(step - self._bar.n)
        elif self._progress == "plain":
            done = step - self._start_step
            elapsed = time.monotonic() - self._t0
            eta = elapsed / max(done, 1) * (self.total_steps - step)
            print(f"{self.name} step {step}/{self.total_steps} {summary} eta {eta:.0f}s", flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a metrics.jsonl file (or a run directory containing one).

    A last line without its newline that does not parse is a write torn by a killed run and
    is left out; any other line that does not parse is an error naming the file and line."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file at {path}")
    return [row for _, row in _parse_lines(path)]


def _parse_lines(path: Path) -> list[tuple[str, dict[str, Any]]]:
    text = path.read_text()
    lines = text.splitlines()
    rows = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append((line, json.loads(line)))
        except json.JSONDecodeError as err:
            if lineno == len(lines) and not text.endswith("\n"):
                break  # torn last write
            raise ValueError(f"{path}:{lineno}: not a JSON line ({err})") from None
    return rows


def _truncate_after(path: Path, step: int) -> None:
    if not path.is_file():
        return
    keep = [line for line, row in _parse_lines(path) if row.get("step", 0) <= step]
    path.write_text("".join(line + "\n" for line in keep))


def _as_float(value: Any) -> Optional[float]:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "numel", lambda: 1)() == 1:
        return float(item())
    return None
