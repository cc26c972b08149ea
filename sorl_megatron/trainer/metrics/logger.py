"""Run logging: JSONL metrics per step, TensorBoard scalars, optional Weights & Biases,
console progress with ETA (a tqdm bar on a terminal; one plain line per step when the output
goes to a file or a pipe, which a bar's carriage returns would fill with redraws).

Only rank 0 writes. Each JSONL line is ``{"step": int, "time": float, <metric>: float, ...}``
with the metric names the losses and engine produce (``actor/clip_frac``,
``actor/clip_bias/norm``, ``rollout/reward``, ``val/em``, ``time/rollout`` ...), which
``tools/plot.py`` reads back.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Optional

from tqdm import tqdm

from ...algorithms.diagnostics import Histogram


def _is_terminal(stream: Any) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no such method, or a closed stream
        return False


def show_trainer_log(level: int = logging.INFO) -> None:
    """Print the trainer's own log records (PVPO counts, warnings) on the console, leaving
    other libraries' loggers as they are; idempotent (entry points call it, not the library)."""
    logger = logging.getLogger("sorl_megatron")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(name)s] %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(level)


WANDB_ID_FILE = "wandb_run_id"  # in the run directory: a resumed run continues its W&B run


def open_wandb(settings: Any, run_dir: str | Path, run_name: str, config: Mapping[str, Any], resume: bool):
    """Start (or, when ``resume``, continue) the W&B run of a training run; None when
    ``settings.mode`` is disabled. ``settings`` is the recipe's ``logging.wandb``.

    The W&B files go to ``$WANDB_DIR`` when set, else into the run directory; the W&B run id
    is kept in ``<run_dir>/wandb_run_id`` so that a resumed run logs into the same W&B run.
    ``wandb.init`` waits at most ``settings.init_timeout_s``."""
    if settings.mode == "disabled":
        return None
    import wandb  # optional dependency: the recipe check said so if it is missing

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    id_file = run_dir / WANDB_ID_FILE
    run_id = id_file.read_text().strip() if resume and id_file.is_file() else ""
    if not run_id:
        run_id = secrets.token_hex(6)  # W&B ids: lowercase letters and digits
        id_file.write_text(run_id + "\n")
    return wandb.init(
        project=settings.project,
        entity=settings.entity,
        name=settings.name or run_name,
        mode=settings.mode,
        id=run_id,
        resume="allow",
        dir=os.environ.get("WANDB_DIR") or str(run_dir),
        config=dict(config),
        settings=wandb.Settings(init_timeout=settings.init_timeout_s),
    )


class MetricsLogger:
    """Append-only JSONL + optional TensorBoard + optional W&B + a progress line per step.

    With ``wandb_run`` (see :func:`open_wandb`) each row also goes to W&B, plotted against
    ``<name>/step`` (``sft/step`` for the SFT stage, ``rl/step`` for RL), so that one W&B
    run holds both curves; the logger does not finish the W&B run, its opener does.
    """

    def __init__(
        self,
        run_dir: str | Path,
        total_steps: int,
        tensorboard: bool = True,
        progress: str = "tqdm",
        enabled: bool = True,
        start_step: int = 0,
        name: str = "rl",  # the progress line's label
        wandb_run: Any = None,
    ) -> None:
        self.enabled = enabled
        self.name = name
        self._wandb = wandb_run if enabled else None
        self._wandb_step = f"{name}/step"
        self._wandb_keys: set[str] = set()
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
        if progress == "tqdm" and not _is_terminal(sys.stderr):
            progress = "plain"  # a redirected log gets one line per step, not tqdm's \r-redrawn bar
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
        if self._wandb is not None:
            values = {k: v for k, v in row.items() if k not in ("step", "time") and v is not None}
            if self._wandb_step not in self._wandb_keys:
                self._wandb.define_metric(self._wandb_step)
                self._wandb_keys.add(self._wandb_step)
            for key in sorted(values.keys() - self._wandb_keys):  # exact names: no glob precedence to rely on
                self._wandb.define_metric(key, step_metric=self._wandb_step)
                self._wandb_keys.add(key)
            self._wandb.log({**values, self._wandb_step: int(step)})
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
