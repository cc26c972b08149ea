"""What runs before or beside the RL steps: the SFT cold start (resumable from its own
checkpoints, ``<checkpoint.dir>/sft/step_K``) and PVPO's reference pass.

Both play episodes on rank 0 (through :class:`~.connections.Connections`) and hand every rank
the result; the engines they train or read are the trainer's.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ...bridge.model import ModelOptions
from ...common import comm
from ...data.gold import cold_start_plans
from ...data.qa import QARow
from ...engine.actor import ActorConfig, PolicyEngine
from ...engine.checkpoint import (
    load_engine_checkpoint,
    newest_checkpoint,
    prune_checkpoints,
    read_checkpoint_meta,
    save_engine_checkpoint,
)
from ...engine.config import OptimConfig
from ...rewards.registry import RewardRegistry
from ..groups.producer import Group
from ..groups.prompts import DataStream
from ..metrics.logger import MetricsLogger
from ..metrics.timing import StepTimer
from ..recipe.config import TrainConfig
from ..recipe.inputs import InputError
from ..rerun import SFT_DONE, sft_checkpoint_root, sft_finished, sft_model_dir
from ..serving.connections import Connections
from .pvpo import PVPOState, group_sampling, inject_ground_truth, reference_statistics
from .sft import run_sft

log = logging.getLogger("sorl_megatron.trainer")


def sft_resume_point(cfg: TrainConfig) -> Optional[Path]:
    """The SFT checkpoint an unfinished SFT stage resumes from: the newest verified one under
    ``<checkpoint.dir>/sft`` (all ranks call it); None to start at step 0 (none there, SFT off
    or finished, or ``checkpoint.resume=none``)."""
    if not cfg.sft.enabled or sft_finished(cfg) or cfg.checkpoint.resume == "none":
        return None
    return newest_checkpoint(sft_checkpoint_root(cfg))


def sft_stage(cfg: TrainConfig, run_dir: Path, rows: list[QARow], conn: Optional[Connections], pad_id: int,
              model_options: ModelOptions, wandb_run: Any = None, resume: Optional[Path] = None,
              on_phase: Callable[[str], None] = lambda phase: None) -> str:
    """Cold-start SFT on gold trajectories; returns the HF directory RL starts from (already
    there when a finished SFT left ``SFT_DONE``). With ``resume`` (:func:`sft_resume_point`)
    the engine, its optimizer, scheduler and the RNG continue from that checkpoint's step, and
    the steps after it are the uninterrupted run's. ``on_phase`` hears what the stage is doing."""
    sft = cfg.sft
    out = sft_model_dir(cfg)
    if (out / SFT_DONE).is_file():
        return str(out)

    def demonstrations():
        plans = cold_start_plans(rows, sft.direct_answer_fraction, cfg.schedule.seed)
        gold = conn.gold_trajectories(sorted(plans), plans=plans)
        return [gold[i] for i in sorted(gold)]

    on_phase("the SFT demonstrations")
    trajs = comm.on_rank0(demonstrations, "the SFT demonstrations", cfg.parallelism.rank0_phase_timeout_s)
    start = _checkpoint_step(resume, len(trajs), sft.steps) if resume is not None else 0
    engine = PolicyEngine(cfg.model.path, cfg.parallelism, ActorConfig(
        loss=cfg.algorithm.loss, optim=OptimConfig(lr=sft.lr, clip_grad=cfg.optimizer.clip_grad),
        batching=sft.batching(cfg.schedule)),
        model_options=model_options)
    engine.config_prefix = "schedule"
    if resume is not None:
        load_engine_checkpoint(str(resume), engine)  # weights, Adam, LR schedule, step counter, RNG
        if comm.rank() == 0:
            log.info("SFT: resuming from step %d of %d (%s)", start, sft.steps, resume)
    root = sft_checkpoint_root(cfg)

    def after_step(step: int) -> None:
        # the last step's state is sft_model itself; saving reads the RNG, never draws from it
        if sft.save_every and step % sft.save_every == 0 and step < sft.steps:
            on_phase(f"the SFT checkpoint of step {step}")
            save_engine_checkpoint(str(root / f"step_{step}"), engine,
                                   extra={"sft_step": step, "demonstrations": len(trajs)})
            prune_checkpoints(root, cfg.checkpoint.keep_last)
        on_phase(f"SFT step {step + 1} of {sft.steps}" if step < sft.steps else "the SFT policy's save")

    sft_log = MetricsLogger(run_dir / "sft", sft.steps, cfg.logging.tensorboard, cfg.logging.progress,
                            enabled=comm.rank() == 0, name="sft", wandb_run=wandb_run, start_step=start)
    on_phase(f"SFT step {start + 1} of {sft.steps}")
    try:
        run_sft(engine, trajs, sft.steps, sft.batch_size, cfg.schedule.seed, pad_id, out,
                on_step=lambda step, m: sft_log.log(
                    step, {f"sft/{k}" if not k.startswith("sft/") else k: v for k, v in m.items()}),
                start_step=start, after_step=after_step)
    finally:
        sft_log.close()
    if comm.rank() == 0:
        shutil.rmtree(root, ignore_errors=True)  # sft_model is written: nothing resumes from them any more
    return str(out)


def _checkpoint_step(path: Path, demonstrations: int, steps: int) -> int:
    """The step an SFT checkpoint was saved after, if this run can resume from it."""
    _, _, extra = read_checkpoint_meta(path)
    try:
        step, saved = int(extra["sft_step"]), int(extra["demonstrations"])
    except (KeyError, TypeError, ValueError):
        raise InputError(f"{path}/trainer.json: no sft_step / demonstrations (not an SFT checkpoint)") from None
    if saved != demonstrations:
        raise InputError(f"SFT checkpoint {path} was trained on {saved} demonstrations, the data now give "
                         f"{demonstrations}: the same data resume it (checkpoint.resume=none starts over)")
    if step >= steps:
        raise InputError(f"SFT checkpoint {path} is at step {step}, not before sft.steps={steps}: raise sft.steps "
                         "(checkpoint.resume=none starts over)")
    return step


class PVPOStage:
    """PVPO's static value baseline: the reference pass (M rollouts per prompt with the policy
    the servers hold), group sampling at step 0, its refreshes, and ground-truth injection."""

    def __init__(self, cfg: TrainConfig, stream: DataStream, rewards: RewardRegistry,
                 conn: Optional[Connections]):
        self.cfg = cfg
        self.stream = stream  # group sampling keeps only the prompts it trains on
        self.rewards = rewards
        self.conn = conn
        self.state: Optional[PVPOState] = None

    def refresh_due(self, step: int) -> bool:
        return (self.state is not None and self.cfg.algorithm.pvpo.refresh_due(step)
                and self.state.refreshed_at_step < step)

    def reference_pass(self, step: int = 0) -> dict[str, float]:
        """Static V and, at step 0 (the initial policy), group sampling. Later calls
        (``pvpo.refresh_every`` / ``refresh_at``) refresh static V and accuracy of the kept
        prompts without re-filtering them. Returns the ``pvpo/*`` metrics of the pass."""
        p = self.cfg.algorithm.pvpo
        timer = StepTimer()
        phase = f"the PVPO reference pass before step {step + 1}"

        def play() -> PVPOState:
            self.conn.check_servers(phase)
            res = self.conn.rollouts(self.stream.indices, p.num_ref_rollouts,
                                     seed=self.cfg.schedule.seed + 7 + 1_000_033 * step, rewards=self.rewards)
            return reference_statistics(res.rewards, res.group_ids, step=step)

        with timer("pvpo_reference"):
            self.state = comm.on_rank0(play, phase, self.cfg.parallelism.rank0_phase_timeout_s)
        v = list(self.state.static_v.values())
        metrics = {"pvpo/static_v_mean": sum(v) / max(len(v), 1)}
        if step > 0:
            log.info("PVPO: static V refreshed at step %d (mean %.3f)", step, metrics["pvpo/static_v_mean"])
            return {**metrics, **timer.times}
        split = group_sampling(self.state, p.drop_solved)
        self.stream.indices = split.keep
        metrics.update({"pvpo/kept": len(split.keep), "pvpo/dropped": len(split.dropped),
                        "pvpo/unsolved": len(split.unsolved)})
        log.info("PVPO: %d prompts kept, %d dropped as solved, %d unsolved",
                 len(split.keep), len(split.dropped), len(split.unsolved))
        if p.inject_ground_truth:
            have = comm.on_rank0(lambda: len(self.conn.gold_for(split.unsolved)), "PVPO's ground-truth trajectories",
                                 self.cfg.parallelism.rank0_phase_timeout_s)
            metrics["pvpo/ground_truth_available"] = have
            if split.unsolved and not have:
                log.warning(
                    "PVPO: algorithm.pvpo.inject_ground_truth is on but none of the %d unsolved prompts has a complete "
                    "ground-truth trajectory (rows need extra_info.gold_searches that fit the rollout budgets): "
                    "nothing will be injected",
                    len(split.unsolved),
                )
        return {**metrics, **timer.times}

    def inject(self, group: Group) -> None:
        """Ground truth into an unsolved prompt's scored group (rank 0), in place."""
        if self.state is None or not self.cfg.algorithm.pvpo.inject_ground_truth:
            return
        unsolved = group_sampling(self.state).unsolved
        if group.prompt in set(unsolved):
            n = len(group.trajectories)
            gids = torch.full((n,), group.prompt, dtype=torch.long)
            group.trajectories, group.injected = inject_ground_truth(
                group.trajectories, gids, group.rewards, self.conn.gold_for([group.prompt]), unsolved)
            group.rewards = torch.where(group.injected, torch.ones_like(group.rewards), group.rewards)

    def values_for(self, group_ids: torch.Tensor) -> Optional[torch.Tensor]:
        return self.state.values_for(group_ids) if self.state is not None else None

    def to_json(self) -> Optional[dict[str, Any]]:
        if self.state is None:
            return None
        s = self.state
        return {"static_v": s.static_v, "accuracy": s.accuracy, "refreshed_at_step": s.refreshed_at_step,
                "keep": self.stream.indices}

    def load_json(self, p: dict[str, Any]) -> None:
        self.state = PVPOState({int(k): v for k, v in p["static_v"].items()},
                               {int(k): v for k, v in p["accuracy"].items()}, p["refreshed_at_step"])
        self.stream.indices = list(p["keep"])

