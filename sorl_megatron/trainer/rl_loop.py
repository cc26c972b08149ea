"""The RL loop: rollouts -> rewards -> old/ref log-probs, values -> advantages -> actor and
critic updates -> weight sync -> validation -> checkpoint.

Every rank runs the Megatron engines; rank 0 alone talks HTTP for rollouts, retrieval and
health (:class:`~.serving.connections.Connections`, which only rank 0 builds) and sends each step's
batch to the other ranks as tensors (the R3 routes only for the rows each data-parallel rank's
passes read, ``engine/batch_transfer.py``), which then cut their own data-parallel rows, except in the
distributed weight sync, where every sending rank announces its own buckets to the servers
(docs/concepts/weight-sync.md). The off-policyness is explicit in the recipe: ``schedule.batch_size x
rollout.group_size`` trajectories per step, split into mini-batches of
``schedule.mini_batch_size`` (one optimizer step each) over ``schedule.ppo_epochs`` epochs
(SORL appendix A.5). Everything is seeded per step, so a run killed at any point and resumed
from its latest checkpoint reproduces the uninterrupted run on CPU.

Where a step's groups come from (``rollout.mode``) is the rollout source's business
(``sources/``); the SFT cold start and PVPO's reference pass are in ``stages/``, the engines'
building in ``engines.py`` and the checkpoints in ``checkpoints.py``.
"""

from __future__ import annotations

import logging
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Optional

import torch
from transformers import PreTrainedTokenizerBase

from ..algorithms import AdvantageInputs, compute_advantages
from ..bridge.parallel import init_distributed
from ..common import comm, interrupts
from ..common.typed_config import to_dict
from ..data.qa import QARow
from ..engine.actor import PolicyEngine
from ..engine.batch_transfer import share_batch
from ..engine.critic import ValueEngine
from ..engine.rl_batch import RLBatch
from ..rewards.registry import RewardRegistry
from .checkpoints import RunCheckpoints
from .engines import build_engines
from .groups.prompts import DataStream
from .groups.rollouts import rollout_metrics, step_batch
from .metrics.indicators import mismatch_metrics, route_flip_metrics
from .metrics.logger import MetricsLogger, open_wandb
from .metrics.timing import StepTimer, tokens_per_second, truncate_jsonl
from .recipe.config import TrainConfig
from .recipe.inputs import check_resume_dir, load_tokenizer, validate_inputs
from .recipe.loader import dump_config
from .recipe.model_options import model_options
from .recipe.run_settings import SETTINGS_ENTRY, defining_settings, write_checkpoint_dir_record
from .rerun import interrupted, set_aside_previous_run
from .serving.catch_up import served
from .serving.connections import Connections
from .serving.servers import EmbeddedServers
from .serving.weight_push import WeightPush
from .sources.modes import RolloutSource, make_rollout_source, source_class
from .stages.drivers import PVPOStage, sft_resume_point, sft_stage

log = logging.getLogger("sorl_megatron.trainer")

def start_message(cfg: TrainConfig, resume: Optional[Path], step: int) -> tuple[bool, str]:
    """Whether a run has steps left to train, and the line that says what it does: start,
    resume (from which step of how many), or nothing because it is finished (and then how to
    extend it or start over)."""
    name, total = cfg.logging.run_name, cfg.schedule.total_steps
    run_dir = Path(cfg.logging.dir) / name
    if resume is None:
        return True, f"starting run {name}: {total} RL steps, logs and checkpoints in {run_dir}"
    if step < total:
        return True, f"resuming run {name} from step {step} of {total} ({resume})"
    from .recipe.run_settings import rerun_command  # imported here: edits of this module stay in this function

    def command(override: str) -> str:  # the command as it was typed (make demo ARGS=..., python -m ...)
        typed = rerun_command(override)
        return f"`{typed}`" if typed else f"the same command with {override}"

    o = cfg.optimizer
    if o.lr_schedule != "constant" and o.decay_steps is None:
        extend = (f"its LR schedule (optimizer.lr_schedule={o.lr_schedule}) decays over the run's length, so it "
                  "cannot be extended")
    else:
        extend = f"to train it further, run {command(f'schedule.total_steps={max(step, total) + total}')}"
    return False, (
        f"run {name} is finished: its checkpoint {resume} is at step {step} of schedule.total_steps={total}. "
        f"Nothing to do; {extend}; to start over, run {command('checkpoint.resume=none')}, remove {run_dir} or "
        "pick another logging.run_name"
    )


def gpu_memory_metrics() -> dict[str, float]:
    """This process's CUDA allocator peaks since the last call, in GiB (empty without CUDA):
    what the memory plan (``--print-memory``) estimates, measured. The peaks restart here."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return {}
    out = {"memory/peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
           "memory/peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30}
    torch.cuda.reset_peak_memory_stats()
    return out


def validation_sample(n: int, max_rows: int) -> list[int]:
    """The validation rows each evaluation plays: every row, or at most ``max_rows`` of them
    (``data.val_max_rows``), a fixed seeded sample in row order, the same at every evaluation."""
    if max_rows <= 0 or max_rows >= n:
        return list(range(n))
    return sorted(torch.randperm(n, generator=torch.Generator().manual_seed(0))[:max_rows].tolist())


class RLTrainer:
    """Owns the engines, the checkpoints and the loop of one run.

    All state is declared here. What a run builds later starts empty and is set once, before
    the loop reads it: the data, tokenizer, connections (rank 0), rollout source and PVPO stage
    (:meth:`run`), and the engines (:meth:`build_engines`).
    """

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.run_dir = Path(cfg.logging.dir) / cfg.logging.run_name
        self.checkpoints = RunCheckpoints(cfg.checkpoint)
        self.rewards = RewardRegistry(metric_override=cfg.reward.metric, format_weight=cfg.reward.format_weight)
        # data (run)
        self.rows: list[QARow] = []
        self.val_rows: list[QARow] = []
        self.stream = DataStream([], cfg.schedule.batch_size, cfg.schedule.seed, cfg.data.shuffle)
        self.tokenizer: Optional[PreTrainedTokenizerBase] = None
        self.pad_id = 0
        # engines (build_engines)
        self.actor: Optional[PolicyEngine] = None
        self.ref: Optional[PolicyEngine] = None  # only with a KL penalty
        self.critic: Optional[ValueEngine] = None  # only for critic estimators (GAE)
        # servers and clients (rank 0), where groups come from, PVPO (attach)
        self.conn: Optional[Connections] = None
        self.source: Optional[RolloutSource] = None
        self.pvpo: Optional[PVPOStage] = None  # only with the pvpo estimator
        self.wandb_run: Any = None  # rank 0, with logging.wandb.mode online / offline (run)
        self.weights = WeightPush(cfg.rollout, self.run_dir)  # the transport rollout.weight_sync.transport names
        self.synced = 0  # the weight version the servers hold: the last sync's (a catch-up sync repeats it)
        self.phase = "the set-up"  # what the run is doing now: an interrupt's message names it

    # -- set-up ------------------------------------------------------------------------

    def attach(self, rows: list[QARow], val_rows: list[QARow], tokenizer: Any) -> None:
        """The run's data, its connections (rank 0), rollout source and PVPO stage."""
        cfg = self.cfg
        self.rows, self.val_rows, self.tokenizer = rows, val_rows, tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0
        self.stream.indices = list(range(len(rows)))
        if comm.rank() == 0:
            self.conn = Connections(cfg, self.run_dir, rows, tokenizer, pauses=source_class(cfg).pauses(cfg.rollout))
        if cfg.algorithm.advantage.estimator == "pvpo":
            self.pvpo = PVPOStage(cfg, self.stream, self.rewards, self.conn)
        self.source = make_rollout_source(cfg, self.stream, rows, self.rewards, conn=self.conn, pvpo=self.pvpo,
                                          run_dir=self.run_dir)

    def build_engines(self, policy_path: str) -> None:
        engines = build_engines(self.cfg, policy_path)
        self.actor, self.ref, self.critic = engines.actor, engines.ref, engines.critic

    # -- checkpoints -------------------------------------------------------------------

    def save(self, step: int) -> None:
        extra = {"step": step, "producer": self.source.state_json(), SETTINGS_ENTRY: defining_settings(self.cfg)}
        if self.pvpo is not None and self.pvpo.state is not None:
            extra["pvpo"] = self.pvpo.to_json()
        files = self.source.checkpoint_files() if comm.rank() == 0 else {}
        self.checkpoints.save(step, self.actor, self.critic, extra, files)

    def restore(self, path: Path) -> int:
        extra = self.checkpoints.load(path, self.actor, self.critic)
        if "pvpo" in extra and self.pvpo is not None:
            self.pvpo.load_json(extra["pvpo"])
        step = int(extra["step"])
        # older checkpoints: each step trained on batch_size groups, in order
        self.source.load_json(extra.get("producer") or {"frontier": step * self.cfg.schedule.batch_size})
        if comm.rank() == 0:
            self.source.restore_files(path)
        return step

    # -- servers -----------------------------------------------------------------------

    def check_servers(self, phase: str, retrieval: bool = True) -> None:
        """Rank 0: every server ``phase`` uses answers its health check (``Connections.check_servers``)."""
        if self.conn is not None:
            self.conn.check_servers(phase, retrieval)

    def sync_weights(self, step: int) -> None:
        """Push the actor's weights after ``step`` RL steps to the rollout servers."""
        self.weights.sync(self.actor, self.conn, step)
        self.synced = step

    # -- the step ----------------------------------------------------------------------

    def _share_batch(self, batch: Optional[RLBatch]) -> RLBatch:
        """Rank 0's step batch on every rank as tensors, the R3 routes only for the rows each
        data-parallel rank's actor passes read (``engine/batch_transfer.py``)."""
        return share_batch(batch, self.actor.dp_rows, self.actor.ranks["dp_rank"])

    def _old_from_update(self) -> bool:
        """Whether the update's first mini-batch takes its old log-probs from its own forward
        (``schedule.old_logprobs_from_update``): not where the old pass must see every row's
        routes (R2 records them; the route-flip indicator counts them when the rollout returns
        routes, R3 included: so no routes travel by rows, ``_share_batch``, while it is on), nor
        where forward-only passes run under FP8 and the update does not."""
        cfg = self.cfg
        return (cfg.schedule.old_logprobs_from_update and cfg.algorithm.routing_replay != "r2"
                and not cfg.rollout_routes and self.actor.update_forward_is_forward_pass)

    def _records_routes(self) -> bool:
        """Whether the old pass records the routes (R2 replays them; without replay, recorded
        routes meet the rollout's: the route-flip rate)."""
        replay = self.cfg.algorithm.routing_replay
        return replay == "r2" or (replay == "off" and self.cfg.rollout_routes)

    def advantages(self, batch: RLBatch, rewards: torch.Tensor, values: Optional[torch.Tensor]):
        """The recipe's estimator (``algorithms.advantages`` registry) on this batch."""
        a = self.cfg.algorithm.advantage
        static = self.pvpo.values_for(batch.group_ids) if self.pvpo is not None else None
        inputs = AdvantageInputs(rewards, batch.loss_mask, values, batch.group_ids, static)
        return compute_advantages(a.estimator, inputs, gamma=a.gamma, lam=a.lam, normalize_std=a.normalize_std,
                                  whiten=a.whiten)

    def step(self, step: int) -> dict[str, float]:
        cfg = self.cfg
        timer = StepTimer()
        metrics: dict[str, float] = {}
        wall0, busy0 = time.perf_counter(), self.source.busy.seconds()
        gpu_memory_metrics()  # the step's peaks start here (validation and checkpoints are not in them)
        with timer("rollout"):
            held: dict[str, RLBatch] = {}  # rank 0's batch: sent as tensors below, not pickled

            def rollout():
                res, injected, batch_metrics = self.source.next_batch(step)
                held["batch"] = step_batch(res, self.pad_id, self.cfg.algorithm.routing_replay == "r3", held)
                return injected, res.rewards, batch_metrics

            phase = f"the rollout phase of step {step + 1}"
            injected, rewards, rollout_metrics_ = self._served(rollout, phase)
            batch = self._share_batch(held.get("batch"))
        metrics.update(rollout_metrics_)
        metrics["rollout/injected_ground_truth"] = float(injected.sum())
        # rows whose old log-probs the update's first mini-batch takes from its own forward: until the
        # update, batch.old_logprobs is 0 there (nothing before it reads them: advantages, ref, values)
        from_update = None
        with timer("old_logprobs"):
            record = self._records_routes()
            rows = None
            if self._old_from_update():
                first = self.actor.first_mini_batch_rows(batch.batch_size)
                rows = (~first).nonzero().flatten()
                from_update = first & ~injected  # PVPO's GT rows keep their behaviour log-probs
            out = None  # no old pass at all when the first mini-batch is the whole batch
            if rows is None or len(rows):
                out = self.actor.compute_logprobs(batch, record_routing=record, rows=rows)
            lp = out.logprobs if out is not None else torch.zeros_like(batch.rollout_logprobs)
            old = torch.where(injected[:, None], batch.rollout_logprobs, lp)  # PVPO eq. 6 for GT rows
            batch = batch.replace(old_logprobs=old)
            if cfg.algorithm.routing_replay == "r2":
                batch = batch.replace(routed_experts=out.routed_experts)
            # R3: how often the trainer's own router disagrees with the rollout engine's routes
            # (the update's actor/routing/* say the same of the replayed routes after each step)
            metrics.update({f"old/{k}": v for k, v in (out.metrics if out is not None else {}).items()})
        if out is not None:
            metrics.update(route_flip_metrics(held.get("rollout_routes"), out.routed_experts, injected, out.metrics))
        if self.ref is not None:
            with timer("ref_logprobs"):
                # the reference never replays routes (and holds none of the actor's update rows)
                ref_out = self.ref.compute_logprobs(batch.replace(routed_experts=None))
                batch = batch.replace(ref_logprobs=ref_out.logprobs)
        values = None
        if self.critic is not None:
            with timer("values"):
                values = self.critic.compute_values(batch)
        adv, returns = self.advantages(batch, rewards, values)
        batch = batch.replace(advantages=adv)
        with timer("actor_update"):
            metrics.update({f"actor/{k}": v for k, v in self.actor.update(batch, from_update).items()})
        if from_update is not None:
            old = torch.where(from_update[:, None], self.actor.forward_old_logprobs, old)
        metrics.update(mismatch_metrics(old, batch.rollout_logprobs, batch.loss_mask, injected))
        if self.critic is not None:
            with timer("critic_update"):
                metrics.update(
                    {
                        f"critic/{k}": v
                        for k, v in self.critic.update(batch.replace(returns=returns, values=values)).items()
                    }
                )
        metrics.update(self.source.before_sync())
        with timer("weight_sync"):
            self.sync_weights(step + 1)
        self.source.after_sync(step + 1)
        metrics.update(gpu_memory_metrics())
        metrics.update(timer.times)
        if self.conn is not None:
            wall = time.perf_counter() - wall0
            metrics["time/trainer_idle"] = sum(v for k, v in metrics.items() if k.startswith("time/trainer_idle_"))
            metrics["time/server_idle"] = max(wall - (self.source.busy.seconds() - busy0), 0.0)
            metrics["time/step_wall"] = wall
            metrics.update(self.conn.get_fleet().metrics())  # failures, retries, restarts: this step's and validation's
        metrics.update(tokens_per_second(timer.times, {
            "old_logprobs": metrics.get("old/batching/tokens"),
            "ref_logprobs": self.ref.batching_metrics()["batching/tokens"] if self.ref is not None else None,
            "values": self.critic.batching_metrics()["batching/tokens"] if values is not None else None,
            "actor_update": metrics.get("actor/batching/tokens"),
            "critic_update": metrics.get("critic/batching/tokens"),
        }))
        return metrics

    def validate(self) -> dict[str, float]:
        """Exact match of greedy episodes on the validation split (rank 0 rolls out), timed."""
        if not self.val_rows:
            return {}
        timer = StepTimer()

        def play() -> dict[str, float]:
            self.conn.check_servers("validation")
            res = self.conn.rollouts(validation_sample(len(self.val_rows), self.cfg.data.val_max_rows), 1, seed=0,
                                     greedy=True, rows=self.val_rows, rewards=RewardRegistry(metric_override="em"))
            payload = {"val/em": float(res.rewards.mean()), **rollout_metrics(res.trajectories, res.rewards, "val")}
            payload.pop("val/reward", None)
            return payload

        with timer("validate"):
            payload = self._served(play, "validation")
        return {**payload, **timer.times}

    def _served(self, fn, phase: str):
        """``fn()`` for a phase the rollout servers serve, on rank 0 (``serving/catch_up.py``)."""
        return served(fn, phase, self.conn, lambda g: self._on_rank0(g, phase),
                      lambda: self.sync_weights(self.synced), self.synced, self.run_dir)

    def _set_phase(self, phase: str) -> None:
        interrupts.check()  # a signal that something swallowed stops the run before the next phase
        self.phase = phase

    def _on_rank0(self, fn, phase: str):
        """``fn()`` on rank 0 (which holds the connections), its result on every rank; the
        others wait at most ``parallelism.rank0_phase_timeout_s`` (``comm.on_rank0``)."""
        return comm.on_rank0(fn, phase, self.cfg.parallelism.rank0_phase_timeout_s)

    # -- the run -----------------------------------------------------------------------

    def run(self) -> dict[str, float]:
        """The whole run. Its input files are checked first (``InputError``, naming the file and
        row), before any server, engine or run directory exists. Ctrl-C or SIGTERM leaves as
        ``rerun.RunInterrupted``, once the servers are stopped: the phase it stopped in and what
        the same command does next."""
        with interrupts.catching():  # never lost: raised at once, and again at the next phase if swallowed
            try:
                return self._run()
            except KeyboardInterrupt as err:
                raise interrupted(err, self.phase, self.cfg) from None

    def _run(self) -> dict[str, float]:
        # the ranks must be known before rank 0 alone starts servers, writes files, plays gold plans
        init_distributed(timeout_s=self.cfg.parallelism.collective_timeout_s)
        cfg = self.cfg
        check_resume_dir(cfg)
        resume = self.checkpoints.resume_point()
        found = self.checkpoints.step_of(resume) if resume is not None else 0
        go_on, message = start_message(cfg, resume, found)
        if not go_on:  # finished: said so before reading the data or starting a server
            if comm.rank() == 0:
                log.info("%s", message)
            return {}
        sft_resume = sft_resume_point(cfg)  # all ranks: the newest verified SFT checkpoint, if SFT is unfinished
        rank0 = comm.rank() == 0
        inputs = validate_inputs(cfg, check_corpus=rank0, rewards=self.rewards)  # rank 0 alone serves retrieval
        if rank0:
            log.info("%s", message)  # starting / resuming, once the inputs are known to be good
        self.attach(inputs.train, inputs.val, load_tokenizer(cfg.model.path))
        with ExitStack() as stack:
            servers = stack.enter_context(EmbeddedServers(self.run_dir))
            if rank0:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                if cfg.checkpoint.resume == "none" and (aside := set_aside_previous_run(cfg)) is not None:
                    log.info("checkpoint.resume=none: run %s starts over; what the previous run wrote (metrics, "
                             "checkpoints) moved to %s and %s", cfg.logging.run_name, aside,
                             Path(cfg.checkpoint.dir) / "previous" / aside.name)
                (self.run_dir / "config.yaml").write_text(dump_config(cfg))
                write_checkpoint_dir_record(cfg)  # checkpoint.dir is this run's, with these settings
                self.wandb_run = open_wandb(cfg.logging.wandb, self.run_dir, cfg.logging.run_name, to_dict(cfg),
                                            resume=resume is not None or sft_resume is not None)
                if self.wandb_run is not None:
                    stack.callback(self.wandb_run.finish)
                self.conn.start_retrieval(servers)
            policy_path = cfg.model.path
            if cfg.sft.enabled:
                policy_path = sft_stage(cfg, self.run_dir, self.rows, self.conn, self.pad_id, model_options(cfg),
                                        self.wandb_run, resume=sft_resume, on_phase=self._set_phase)
            self._set_phase("the set-up of RL")
            self.build_engines(policy_path)
            start = self.restore(resume) if resume is not None else 0
            # only now: a logger opened at step 0 deletes metrics.jsonl, which a resumed run continues
            logger = MetricsLogger(
                self.run_dir,
                cfg.schedule.total_steps,
                cfg.logging.tensorboard,
                cfg.logging.progress,
                enabled=rank0,
                start_step=start,
                wandb_run=self.wandb_run,
            )
            stack.callback(logger.close)
            stack.callback(self.weights.close)
            if rank0:
                if start == 0:
                    (self.run_dir / "episodes.jsonl").unlink(missing_ok=True)
                else:
                    truncate_jsonl(self.run_dir / "episodes.jsonl", start)
                self.conn.start_rollouts(stack, policy_path)
            stack.callback(self.source.close)  # before the servers stop (callbacks run last first)
            if start > 0 or cfg.rollout.urls:
                self.sync_weights(start)  # servers hold the initial checkpoint; bring them to the trainer's weights
            first: dict[str, float] = {}
            if self.pvpo is not None and self.pvpo.state is None:
                self._set_phase("the PVPO reference pass")
                first = self.pvpo.reference_pass()
            last: dict[str, float] = {}
            if start == 0:
                self._set_phase("the validation before RL step 1")
                logger.log(0, {**first, **self.validate()})
            for step in range(start, cfg.schedule.total_steps):
                last = {}
                done = step + 1
                self._set_phase(f"RL step {done} of {cfg.schedule.total_steps}")
                if self.pvpo is not None and self.pvpo.refresh_due(step):
                    last = self.pvpo.reference_pass(step)  # refresh static V with the current policy
                last.update(self.step(step))
                if (cfg.schedule.val_every and done % cfg.schedule.val_every == 0) or done == cfg.schedule.total_steps:
                    self._set_phase(f"the validation after RL step {done}")
                    last.update(self.validate())
                if (
                    cfg.checkpoint.save_every and done % cfg.checkpoint.save_every == 0
                ) or done == cfg.schedule.total_steps:
                    self._set_phase(f"the checkpoint of RL step {done}")
                    timer = StepTimer()
                    with timer("checkpoint"):
                        self.save(done)
                    last.update(timer.times)
                logger.log(done, last)
                for tag, hist in self.actor.histograms.items():  # |log r| of the update (SORL Fig. 4)
                    logger.log_histogram(done, f"actor/{tag}", hist)
            return last
