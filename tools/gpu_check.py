"""The first thing to run on a machine with one GPU (H100 / H200): is everything there, and do
the GPU paths give what their CPU references give? (docs/how-to/gpu-check.md)

    python tools/gpu_check.py                    # every check on CUDA (under 8 minutes on an H100)
    python tools/gpu_check.py --device cpu --quick   # what needs no CUDA (the test suite runs this)
    python tools/gpu_check.py --only kernel_logprobs

One line per check, ``PASS|FAIL|SKIP name: detail``, then a summary; the exit status is 1 when
any check failed. Each check runs in its own child process (``--child NAME``) with a timeout,
so a crash, a hang or a missing package in one never stops the others.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARK = "GPU_CHECK_RESULT "  # the child's last line: MARK + {"status", "detail"}

# What the checks import, the distribution that provides it, and where it comes from on a GPU
# machine without network (docs/how-to/gpu-check.md): "device" = preinstalled there, "wheels" = the folder
# tools/gpu_wheels.sh builds (GPU_WHEELS_ALL=1 adds the "device" ones the lent image already
# has), "optional" = a SKIP, not a FAIL, when absent.
PACKAGES = [
    ("torch", "torch", "device"),
    ("triton", "triton", "device"),
    ("transformers", "transformers", "device"),
    ("numpy", "numpy", "device"),
    ("safetensors", "safetensors", "device"),
    ("tokenizers", "tokenizers", "device"),
    ("yaml", "PyYAML", "device"),
    ("megatron.core", "megatron-core==0.16.1", "wheels"),
    ("mbridge", "mbridge==0.15.1", "wheels"),
    ("omegaconf", "omegaconf", "wheels"),
    ("einops", "einops", "device"),
    ("bm25s", "bm25s", "wheels"),
    ("aiohttp", "aiohttp", "device"),
    ("pyarrow", "pyarrow", "device"),
    ("psutil", "psutil", "device"),
    ("sorl_megatron", "sorl-megatron", "wheels"),
    ("sorl_kernels", "sorl-megatron", "wheels"),
    ("transformer_engine.pytorch", "transformer-engine[pytorch]", "optional"),
]
WHEELS_HINT = "pip install --no-index --find-links wheels/ --no-deps --ignore-requires-python {dist}"


def install_hint(module: str) -> str:
    for name, dist, source in PACKAGES:
        if module == name or module.split(".")[0] == name.split(".")[0]:
            if source == "wheels":
                return WHEELS_HINT.format(dist=dist.split("==")[0] if dist == "sorl-megatron" else dist)
            if source == "device":
                return f"pip install {dist} (expected preinstalled on the GPU machine)"
            return f"optional: pip install {dist} (NVIDIA's wheels or container)"
    return f"pip install {module.split('.')[0]}"


def missing_imports(optional: bool = False) -> list[tuple[str, str]]:
    """(module, reason) for each of PACKAGES this interpreter cannot import (really imported:
    a module that is found but fails to load counts as missing)."""
    import importlib

    out = []
    for module, _dist, source in PACKAGES:
        if (source == "optional") != optional:
            continue
        try:
            importlib.import_module(module)
        except Exception as err:  # ImportError, or a broken build raising anything at import
            out.append((module, f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"))
    return out


# -- the checks (each runs in a child process; raises Skip / AssertionError / returns detail) ----

class Skip(Exception):
    pass


def cuda_device(args) -> str:
    import torch

    if args.device == "cpu":
        return "cpu"
    if not torch.cuda.is_available():
        raise AssertionError("no CUDA device is visible (run with --device cpu for the CPU checks)")
    return "cuda"


def check_env(args) -> str:
    """Versions, and one line per missing package with its install hint."""
    lines = [f"python {sys.version.split()[0]} ({sys.executable})"]
    missing = missing_imports()
    for module, reason in missing:
        print(f"  missing {module}: {reason}; install: {install_hint(module)}", flush=True)
    import importlib.metadata as md

    def version(dist: str) -> str:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return "absent"

    for dist in ("torch", "triton", "transformers", "megatron-core", "mbridge", "transformer-engine",
                 "transformer_engine", "sorl-megatron"):
        v = version(dist)
        if v != "absent" or dist in ("torch", "megatron-core", "mbridge", "sorl-megatron"):
            lines.append(f"{dist} {v}")
    try:
        import torch

        lines.append(f"CUDA {torch.version.cuda}")
        if torch.cuda.is_available():
            nccl = torch.cuda.nccl.version()
            nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
            props = torch.cuda.get_device_properties(0)
            cap = torch.cuda.get_device_capability(0)
            lines += [f"NCCL {nccl}", f"GPU {props.name} {props.total_memory / 2**30:.1f} GiB sm_{cap[0]}{cap[1]}",
                      f"{torch.cuda.device_count()} visible"]
        else:
            lines.append("no CUDA device")
    except Exception as err:
        lines.append(f"torch unusable ({type(err).__name__}: {err})")
    for line in lines:
        print(f"  {line}", flush=True)
    if missing:
        raise AssertionError(f"{len(missing)} package(s) missing: {', '.join(m for m, _ in missing)} "
                             "(one line each above, with the install command)")
    return "; ".join(lines)


def _timed(fn, reps: int, sync) -> list[float]:
    out = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t)
    return out


def _compare_timings(torch_fn, triton_fn, reps: int, device: str) -> str:
    """Interleaved: torch, triton, torch, triton, ... after one warm-up each; medians and ratio."""
    import statistics

    import torch

    if device != "cuda":
        return "no timing on CPU (Triton interpreted)"
    sync = torch.cuda.synchronize
    torch_fn(), triton_fn()  # compile / warm up
    a, b = [], []
    for _ in range(reps):
        a += _timed(torch_fn, 1, sync)
        b += _timed(triton_fn, 1, sync)
    ta, tb = statistics.median(a) * 1e3, statistics.median(b) * 1e3
    return f"torch {ta:.2f} ms, triton {tb:.2f} ms (x{ta / tb:.2f}, median of {reps} interleaved)"


def _max_diff(a, b) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def _assert_close(name: str, got, ref, atol: float, rtol: float = 0.0) -> float:
    diff = _max_diff(got, ref)
    bound = atol + rtol * float(ref.double().abs().max())
    if not diff <= bound:  # also catches NaN
        raise AssertionError(f"{name}: max |triton - torch| = {diff:.3g} > {bound:.3g}")
    return diff


def check_kernel_logprobs(args) -> str:
    import torch

    from sorl_megatron.algorithms import dispatch

    device = cuda_device(args)
    # Qwen3's real vocabulary (151,936), Qwen2.5's (152,064) and an odd width
    rows, widths = (16, (1000, 1031)) if args.quick or device == "cpu" else (4096, (151936, 152064, 151665))
    details = []
    for vocab in widths:
        g = torch.Generator(device=device).manual_seed(vocab)
        logits = (torch.randn(rows, vocab, device=device, generator=g) * 3).to(torch.bfloat16)
        targets = torch.randint(0, vocab, (rows,), device=device, generator=g)
        up_lp = torch.randn(rows, device=device, generator=g)
        up_ent = torch.randn(rows, device=device, generator=g)

        def run(name: str):
            x = logits.detach().requires_grad_(True)
            with dispatch.backend(name):
                lp, ent = dispatch.token_logprobs_entropy(x, targets)
            (lp * up_lp + ent * up_ent).sum().backward()
            return lp.detach(), ent.detach(), x.grad

        ref, got = run("torch"), run("triton")
        d_lp = _assert_close(f"logprobs [{rows}, {vocab}]", got[0], ref[0], atol=2e-3, rtol=1e-3)
        d_ent = _assert_close(f"entropy [{rows}, {vocab}]", got[1], ref[1], atol=2e-3, rtol=1e-3)
        d_grad = _assert_close(f"d logits [{rows}, {vocab}]", got[2].float(), ref[2].float(), atol=1e-4, rtol=1e-2)
        del ref, got
        timing = _compare_timings(lambda: run("torch"), lambda: run("triton"), args.reps, device)
        memory = _peak_memory(run, device)
        details.append(f"bf16 [{rows}, {vocab}] fwd+bwd max diff lp {d_lp:.1e} ent {d_ent:.1e} "
                       f"grad {d_grad:.1e}; {timing}{memory}")
    return " | ".join(details)


def _peak_memory(run, device: str) -> str:
    """Each backend's peak allocation above the inputs for one forward and backward (CUDA only):
    the fused kernel must not hold more than torch's materialized fp32 log-softmax."""
    if device != "cuda":
        return ""
    import torch

    peaks = {}
    for name in ("torch", "triton"):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run(name)
        torch.cuda.synchronize()
        peaks[name] = (torch.cuda.max_memory_allocated() - base) / 2**30
    if peaks["triton"] > peaks["torch"] * 1.05:
        raise AssertionError(f"the log-prob kernel's peak {peaks['triton']:.2f} GiB exceeds torch's "
                             f"{peaks['torch']:.2f} GiB")
    return f"; peak above inputs torch {peaks['torch']:.2f} GiB, triton {peaks['triton']:.2f} GiB"


def check_kernel_segment(args) -> str:
    import torch

    from sorl_megatron.algorithms import dispatch

    device = cuda_device(args)
    tokens, segments = (512, 37) if args.quick or device == "cpu" else (4096 * 16, 4096)
    details = []
    g = torch.Generator().manual_seed(0)
    # unsorted, interleaved segment ids (turns of one rollout need not be contiguous), and
    # tokens outside every segment (index == segments)
    seg = torch.randint(0, segments + 1, (tokens,), generator=g)
    seg[torch.randperm(tokens, generator=g)[:segments]] = torch.arange(segments)  # no empty segment
    length = torch.bincount(seg, minlength=segments + 1)[:segments]
    seg, length = seg.to(device), length.to(device)
    for dtype, atol in ((torch.float32, 1e-5), (torch.float64, 1e-12)):
        values = torch.randn(tokens, generator=g, dtype=dtype).to(device)
        up = torch.randn(tokens, generator=g, dtype=dtype).to(device)

        def run(name: str):
            x = values.detach().requires_grad_(True)
            with dispatch.backend(name):
                y = dispatch.segment_mean_broadcast(x, seg, length)
            (y * up).sum().backward()
            return y.detach(), x.grad

        ref, got = run("torch"), run("triton")
        d_y = _assert_close(f"segment mean {dtype}", got[0], ref[0], atol=atol, rtol=atol)
        d_g = _assert_close(f"segment mean grad {dtype}", got[1], ref[1], atol=atol, rtol=atol)
        timing = _compare_timings(lambda: run("torch"), lambda: run("triton"), args.reps, device)
        details.append(f"{str(dtype)[6:]} {tokens} tokens / {segments} unsorted segments max diff y {d_y:.1e} "
                       f"grad {d_g:.1e}; {timing}")
    return " | ".join(details)


def check_kernel_surrogate(args) -> str:
    import torch

    from sorl_megatron.algorithms import dispatch

    device = cuda_device(args)
    shape = (4, 128) if args.quick or device == "cpu" else (256, 8192)
    g = torch.Generator().manual_seed(0)
    ratio = torch.exp(0.3 * torch.randn(shape, generator=g)).to(device)
    ratio.view(-1)[:8] = torch.tensor([0.8, 1.28, 3.0, 1.0, 0.5, 5.0, 1.2, 0.79])  # the ties and bounds
    adv = torch.randn(shape, generator=g).to(device)
    adv.view(-1)[8:12] = 0.0
    mask = (torch.rand(shape, generator=g) > 0.2).to(device)
    up = torch.randn(shape, generator=g).to(device)

    def run(name: str):
        w = ratio.detach().requires_grad_(True)
        with dispatch.backend(name):
            loss, hi, lo, dual = dispatch.clipped_surrogate(w, adv, mask, 0.8, 1.28, 3.0)
        (loss * up).sum().backward()
        return loss.detach(), hi, lo, dual, w.grad

    ref, got = run("torch"), run("triton")
    names = ("loss", "clip_high", "clip_low", "dual", "d ratio")
    diffs = [_assert_close(f"surrogate {n}", b.float(), a.float(), atol=1e-6, rtol=1e-6)
             for n, a, b in zip(names, ref, got)]
    bitwise = all(torch.equal(a, b) for a, b in zip(ref, got))
    timing = _compare_timings(lambda: run("torch"), lambda: run("triton"), args.reps, device)
    return (f"dual-clip [{shape[0]}, {shape[1]}] fwd+bwd max diff {max(diffs):.1e}"
            f"{' (bitwise equal)' if bitwise else ''}; {timing}")


# -- the engine on a tiny MoE --------------------------------------------------------------

@contextlib.contextmanager
def _work_lock(work: Path):
    """Checks running side by side (--jobs) make the shared tiny data and models once."""
    import fcntl

    work.mkdir(parents=True, exist_ok=True)
    with open(work / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _tiny_model(work: Path, arch: str = "qwen3_moe") -> str:
    from sorl_megatron.data.tiny_model import TinyModelConfig, save_tiny_model

    out = work / f"tiny_{arch}"
    with _work_lock(work):
        if not (out / "config.json").is_file():
            save_tiny_model(TinyModelConfig(arch=arch, vocab_size=512, hidden_size=64, intermediate_size=128), out)
    return str(out)


def _batch(rows: int, seq: int, vocab: int, seed: int = 0):
    """Right-padded rows: prompt (no loss), response, a tool observation (no loss), response."""
    import torch

    from sorl_megatron.engine.rl_batch import RLBatch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, seq), generator=g)
    lengths = torch.randint(seq // 2 + 2, seq + 1, (rows,), generator=g)
    pos = torch.arange(seq).unsqueeze(0)
    att = (pos < lengths.unsqueeze(1)).long()
    loss = att.clone()
    loss[:, :4] = 0
    loss[:, seq // 3: seq // 3 + 3] = 0
    adv = torch.randn(rows, 1, generator=g).expand(rows, seq) * loss
    return RLBatch(input_ids=ids, attention_mask=att, loss_mask=loss, advantages=adv.contiguous(),
                   group_ids=torch.arange(rows) // 2)


def _engine(path: str, dtype, trainable: bool = True, fp8=None, replay: str = "off"):
    from sorl_megatron.algorithms import PolicyLossConfig
    from sorl_megatron.bridge.layout import ParallelLayout
    from sorl_megatron.bridge.model import ModelOptions
    from sorl_megatron.engine.actor import ActorConfig, PolicyEngine
    from sorl_megatron.engine.config import BatchingConfig, OptimConfig

    loss = PolicyLossConfig.from_dict({"name": "so_ppo", "is_correction": {"mode": "tis"}})
    cfg = ActorConfig(loss=loss, optim=OptimConfig(lr=1e-3, clip_grad=1.0),
                      batching=BatchingConfig(micro_batch_size=2, mini_batch_size=8), routing_replay=replay)
    return PolicyEngine(path, ParallelLayout(), cfg, trainable=trainable,
                        model_options=ModelOptions(dtype=dtype, fp8=fp8))


def _init_world(device: str) -> str:
    import torch.distributed as dist

    from sorl_megatron.bridge.parallel import GPU_BACKEND, init_distributed

    init_distributed("gloo" if device == "cpu" else GPU_BACKEND, timeout_s=120)
    return str(dist.get_backend_config()) if hasattr(dist, "get_backend_config") else dist.get_backend()


def _finite(metrics: dict) -> dict:
    import math

    return {k: v for k, v in metrics.items() if v is None or (isinstance(v, float) and not math.isfinite(v))}


def check_engine(args) -> str:
    import torch

    device = cuda_device(args)
    backend = _init_world(device)
    path = _tiny_model(Path(args.work))
    actor = _engine(path, torch.bfloat16)
    if actor.model.dtype != torch.bfloat16:
        raise AssertionError(f"the engine built {actor.model.dtype}, not bfloat16")
    batch = _batch(8, 32, 512)
    t = time.perf_counter()
    plain = actor.compute_logprobs(batch, entropy=True)
    r2 = actor.compute_logprobs(batch, record_routing=True)  # R2: the routes every router used
    routed = r2.routed_experts
    att = batch.attention_mask.bool()
    if routed is None or routed.shape[:2] != batch.input_ids.shape or int(routed[att].min()) < 0:
        raise AssertionError(f"R2 record: bad routed_experts {None if routed is None else tuple(routed.shape)}")
    batch = batch.replace(routed_experts=routed)
    r3 = actor.compute_logprobs(batch, replay=True)  # R3: replaying the recorded routes
    for name, out in (("plain", plain.logprobs), ("r2", r2.logprobs), ("r3", r3.logprobs)):
        if not torch.isfinite(out[att]).all():
            raise AssertionError(f"compute_logprobs {name}: non-finite log-probs")
    d_r2 = _max_diff(r2.logprobs[att], plain.logprobs[att])
    d_r3 = _max_diff(r3.logprobs[att], plain.logprobs[att])
    if d_r2 > 0.05 or d_r3 > 0.05:  # the same weights and routes: bf16 noise only
        raise AssertionError(f"log-probs differ between passes: r2 {d_r2:.3g}, r3 {d_r3:.3g} (bf16)")
    old = plain.logprobs + 0.1 * torch.randn(plain.logprobs.shape, generator=torch.Generator().manual_seed(1))
    batch = batch.replace(old_logprobs=old * batch.loss_mask, rollout_logprobs=old * batch.loss_mask,
                          ref_logprobs=plain.logprobs)
    before = {k: v.detach().float().clone() for k, v in actor.model.chunks[0].named_parameters()}
    first = actor.first_mini_batch_rows(batch.batch_size)  # old log-probs from the update's own forward
    padded = actor.update(batch, old_from_forward=first)
    from_update = actor.forward_old_logprobs
    own = att & first.unsqueeze(1)
    if from_update is None or not torch.isfinite(from_update[own]).all():
        raise AssertionError("update: no finite old log-probs from its first mini-batch's forward")
    d_old = _max_diff(from_update[own].to(plain.logprobs.device), plain.logprobs[own])
    if d_old > 0.05:  # the weights compute_logprobs read: bf16 noise only
        raise AssertionError(f"old log-probs from the update's forward differ from the pass's by {d_old:.3g} (bf16)")
    actor.batching.pack_sequences = True
    packed = actor.update(batch)
    after = dict(actor.model.chunks[0].named_parameters())
    moved = sum(float((after[k].detach().float() - v).abs().max()) for k, v in before.items())
    for name, m in (("padded", padded), ("packed", packed)):
        if _finite(m):
            raise AssertionError(f"update {name}: non-finite metrics {_finite(m)}")
    if moved == 0:
        raise AssertionError("two updates left every parameter unchanged")
    loss_key = next((k for k in ("actor/pg_loss", "actor/loss", "loss") if k in packed), None)
    return (f"bf16 tiny MoE on {backend}: compute_logprobs plain/R2-record/R3-replay (max |diff| r2 {d_r2:.1e}, "
            f"r3 {d_r3:.1e}), old log-probs from the update's forward {d_old:.1e}, "
            f"update padded + packed ({loss_key}={packed.get(loss_key, float('nan')):.4g}), "
            f"{time.perf_counter() - t:.1f} s")


def check_fp8_forward(args) -> str:
    """A forward-only pass in TE FP8 (model.fp8) against the same weights in bf16."""
    import torch

    from sorl_megatron.bridge.te_fp8 import Fp8Options, fp8_unavailable_reason

    reason = fp8_unavailable_reason()
    if reason is not None:
        raise Skip(reason)
    device = cuda_device(args)
    _init_world(device)
    details = []
    for arch in ("qwen3", "qwen3_moe"):
        path = _tiny_model(Path(args.work), arch)
        batch = _batch(8, 32, 512)
        att = batch.attention_mask.bool()
        ref = _engine(path, torch.bfloat16, trainable=False).compute_logprobs(batch).logprobs[att]
        for recipe in ("delayed", "blockwise"):
            fp8 = Fp8Options(enabled=True, recipe=recipe)
            got = _engine(path, torch.bfloat16, trainable=False, fp8=fp8).compute_logprobs(batch).logprobs[att]
            if not torch.isfinite(got).all():
                raise AssertionError(f"{arch} {recipe}: non-finite FP8 log-probs")
            mean = float((got - ref).abs().mean())
            if mean > 0.5:
                raise AssertionError(f"{arch} {recipe}: FP8 log-probs are {mean:.3g} nats from bf16 on average")
            details.append(f"{arch} {recipe}: mean |lp_fp8 - lp_bf16| {mean:.2e}, max {_max_diff(got, ref):.2e}")
    return "; ".join(details)


# -- one RL step of the tiny recipe, per weight-sync transport -----------------------------

TINY_RUN = [
    "schedule.total_steps=1", "schedule.batch_size=2", "rollout.group_size=2", "schedule.mini_batch_size=2",
    "schedule.micro_batch_size=1", "rollout.max_turns=2", "rollout.max_turn_tokens=12",
    "rollout.max_total_tokens=340", "rollout.max_obs_tokens=32", "sft.enabled=false", "schedule.val_every=0",
    "data.val=", "logging.progress=none", "logging.tensorboard=false",
    # the tiny recipes pin megatron's unfused attention (their CPU numbers); a GPU without TE runs the default
    "model.local_attention=sdpa",
]


# PPO with its critic, the reference and the critic parked on the CPU between their passes
PPO_OFFLOAD = ("algorithm.loss.name=ppo", "algorithm.advantage.estimator=gae", "algorithm.loss.kl_coef=0.01",
               "model.offload_idle=true")


def _tiny_data(work: Path, hidden_size: int | None = None) -> Path:
    """The synthetic set and model (the generator's default hidden size unless given)."""
    data = work / ("data" if hidden_size is None else f"data_h{hidden_size}")
    with _work_lock(work):
        if not (data / "model" / "config.json").is_file():
            from sorl_megatron.data.synthetic import main as make_data

            size = [] if hidden_size is None else ["--hidden-size", str(hidden_size)]
            make_data(["--out", str(data), "--num-people", "8", "--make-model", "--vocab-size", "512", *size,
                       "--tie-embeddings"])
    return data


def check_memory_plan(args) -> str:
    """One RL step of a 0.12B-parameter MoE (hidden 2048): the trainer's CUDA peak against the
    memory plan's estimate for the same run, which must bound it."""
    if cuda_device(args) != "cuda":
        raise Skip("needs CUDA (it reads the CUDA allocator's peak)")
    return check_rl_step(args, "tensor", hidden_size=2048)


def _expert_gemm_equal(device: str) -> str:
    """``torch._grouped_mm`` against the loop over experts on CUDA in bf16 (forward, input and
    weight gradients; 16 experts, some without tokens, group sizes not multiples of 8)."""
    import torch

    from sorl_megatron.bridge.grouped_gemm import grouped_available, grouped_linear, loop_linear

    g = torch.Generator(device=device).manual_seed(0)
    counts = [0, 37, 5, 0, 61, 1, 90, 13, 0, 24, 77, 3, 0, 50, 9, 30]
    x = torch.randn(sum(counts), 2048, device=device, generator=g).to(torch.bfloat16)
    ws = [(torch.randn(1536, 2048, device=device, generator=g) / 45).to(torch.bfloat16) for _ in counts]
    if not grouped_available(x, 1536):
        return "no grouped kernel for bf16 on this GPU (the experts loop)"
    grad = torch.randn(sum(counts), 1536, device=device, generator=g).to(torch.bfloat16)

    def run(fn):
        leaves = [t.detach().requires_grad_(True) for t in (x, *ws)]
        fn(leaves[0], leaves[1:], torch.tensor(counts, device=device)).backward(grad)
        return [fn(x, ws, counts).float(), *(t.grad.float() for t in leaves)]

    worst = max(_assert_close(f"grouped expert GEMM part {i}", a, b, atol=0.05, rtol=0.02)
                for i, (a, b) in enumerate(zip(run(grouped_linear), run(loop_linear))))
    return f"grouped expert GEMM = loop (bf16, fwd + bwd, 16 experts, 4 empty): max diff {worst:.1e}"


def check_moe_slice(args) -> str:
    """Qwen3-30B-A3B at its real width, two layers (``benchmarks/bench_moe_slice.py``): the grouped
    expert GEMM against the loop on CUDA, then the update's and the log-prob pass's tokens/s and
    model TFLOPS with the split, experts grouped and looped (the report lines). Optional: a SKIP
    without CUDA (the suite runs the benchmark's ``--small`` CPU half)."""
    if cuda_device(args) != "cuda":
        raise Skip("needs CUDA (a real-width benchmark; tests/test_bench_moe_slice.py runs its CPU half)")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_moe_slice

    equal = _expert_gemm_equal("cuda")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        bench_moe_slice.main(["--layers", "2", "--reps", "1" if args.quick else "3"])
    for line in out.getvalue().splitlines():  # the check's report lines
        print("  " + line, flush=True)
    return equal + "; timings in the lines above"


# The second study's worst stress (docs/study.md, recipes/study/round2_*.yaml): 3% of the rollout
# server's (token, layer) top-k choices flipped, rollouts two weight versions old, R3 replaying the
# rollout's routes in the trainer; three steps, so the last trains on a lagged batch
STRESS_RUN = ("rollout.inject.route_flip_fraction=0.03", "rollout.mode=lagged", "rollout.lagged.lag=2",
              "rollout.staleness.max=2", "algorithm.routing_replay=r3", "schedule.total_steps=3")


def check_rl_step_stress(args) -> str:
    """The stress injectors and their indicators on the device: every step's row finite, the
    injected flips seen by the trainer (``mismatch/route_flip_rate`` > 0) and replayed, the last
    batch two versions old."""
    detail, rows, _ = run_rl_steps(args, "tensor", extra=STRESS_RUN, name="rl_stress")
    rows = [r for r in rows if r.get("step", 0) >= 1]  # step 0: the launch's own row
    if len(rows) != 3:
        raise AssertionError(f"{len(rows)} metrics rows, expected 3 (schedule.total_steps=3)")
    flips = [r.get("mismatch/route_flip_rate") for r in rows]
    replayed = [r.get("actor/routing/replayed_pairs") for r in rows]
    kl = [r.get("mismatch/kl_k3") for r in rows]
    lags = [r.get("rollout/version_lag_max") for r in rows]
    if lags[-1] != 2:
        raise AssertionError(f"rollout/version_lag_max per step {lags}: the last step's batch is not 2 versions old")
    if not all(f is not None and f > 0 for f in flips):
        raise AssertionError(f"mismatch/route_flip_rate per step {flips}: the injected flips were not seen")
    if not all(p for p in replayed):
        raise AssertionError(f"routing/replayed_pairs per step {replayed}: R3 replayed nothing")
    return (detail + f"; route flips seen {', '.join(f'{f:.3f}' for f in flips)}, train/inference KL "
            f"{', '.join('n/a' if k is None else f'{k:.2e}' for k in kl)}")


def check_rl_step(args, transport: str, hidden_size: int | None = None) -> str:
    return run_rl_steps(args, transport, hidden_size)[0]


def check_resume_dist_opt(args) -> str:
    """Resume with megatron's distributed optimizer, as every GPU recipe runs it (saving every 50
    steps). Without apex or TE it holds torch's Adam, whose per-parameter step megatron-core 0.16.1's
    checkpoint does not keep: two steps saved each step, then the same run extended to three must
    resume from step 2 and train step 3 with finite metrics, each step's row once."""
    extra = ("optimizer.use_distributed_optimizer=true", "checkpoint.save_every=1")
    run_rl_steps(args, "tensor", extra=(*extra, "schedule.total_steps=2"), name="resume")
    detail, rows, log = run_rl_steps(args, "tensor", extra=(*extra, "schedule.total_steps=3"), name="resume")
    if "from step 2 of 3" not in log:
        tail = " / ".join(line for line in log.splitlines() if "run resume" in line)[-300:]
        raise AssertionError(f"the extended run did not resume from step 2: {tail or 'no start line'}")
    steps = [r.get("step") for r in rows if r.get("step", 0) >= 1]
    if steps != [1, 2, 3]:
        raise AssertionError(f"metrics rows for steps {steps}, expected [1, 2, 3] (each once)")
    return "resumed from step 2 with the distributed optimizer; " + detail


def run_rl_steps(args, transport: str, hidden_size: int | None = None, extra: tuple[str, ...] = (),
                 name: str = "rl") -> tuple[str, list[dict], str]:
    """``sorl_megatron.train`` on the tiny synthetic run: (the detail line, every metrics row, its log)."""
    device = cuda_device(args)
    data = _tiny_data(Path(args.work), hidden_size)
    out = Path(args.work) / "runs"
    name = f"{name}_{transport}_{device}" + ("" if hidden_size is None else f"_h{hidden_size}")
    cmd = [sys.executable, "-m", "sorl_megatron.train", "--config", str(ROOT / "recipes" / "tiny_search_base.yaml"),
           f"model.path={data / 'model'}", f"retrieval.corpus={data / 'corpus.jsonl'}",
           f"data.train={data / 'train.parquet'}", *TINY_RUN, f"rollout.weight_sync.transport={transport}",
           f"logging.dir={out}", f"logging.run_name={name}", f"checkpoint.dir={out / name / 'ckpt'}"]
    if args.quick:  # one short turn per trajectory
        cmd += ["rollout.max_turns=1", "rollout.max_turn_tokens=8"]
    if device == "cuda":
        cmd.append("model.dtype=bfloat16")
    cmd += list(extra)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0") if device == "cuda" else "")
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout - 10)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-6:]
        for log in sorted((out / name / "servers").glob("*.log")):  # an embedded server's own end
            lines = log.read_text(errors="replace").strip().splitlines()
            if any("Error" in line or "Traceback" in line for line in lines):
                tail += [f"[{log.name}]"] + lines[-4:]
        raise AssertionError(f"train exited {proc.returncode}: " + " / ".join(tail))
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if not rows:
        raise AssertionError("no metrics row written")
    m = rows[-1]
    for row in rows:
        bad = _finite(row)  # MetricsLogger writes a non-finite value as null
        if bad:
            raise AssertionError(f"non-finite metrics at step {row.get('step')}: {sorted(bad)[:6]}")
    sync = m.get("time/weight_sync")
    if not sync:
        raise AssertionError(f"no weight sync was timed (time/weight_sync={sync})")
    memory = ""
    if device == "cuda":  # the trainer's measured peak against the memory plan's estimate
        peak = m.get("memory/peak_allocated_gib")
        if peak is None:
            raise AssertionError("no memory/peak_allocated_gib in the metrics row of a CUDA run")
        plan = _memory_plan(cmd[cmd.index("--config") + 1:])
        if peak > plan.total_gib:
            raise AssertionError(f"peak allocated {peak:.2f} GiB exceeds the memory plan's {plan.total_gib:.2f} GiB")
        reserve = sum(i.gib for i in plan.items if i.name == "runtime reserve")
        memory = (f", peak allocated {peak:.3f} GiB / reserved {m['memory/peak_reserved_gib']:.3f} GiB; plan "
                  f"{plan.total_gib:.2f} GiB = {plan.total_gib - reserve:.3f} GiB of states and activations "
                  f"+ {reserve:.1f} runtime reserve ({plan.phase})")
    detail = (f"step {m['step']} on {device}: reward {m.get('rollout/reward', float('nan')):.3f}, "
              f"weight sync {sync:.2f} s, step {time.perf_counter() - t:.1f} s wall{memory}")
    return detail, rows, proc.stdout + proc.stderr


def _memory_plan(config_and_overrides: list[str]):
    """The plan the trainer's own launch check made for the same run (world of one)."""
    from sorl_megatron.trainer.recipe.loader import load_recipe
    from sorl_megatron.trainer.recipe.memory_plan import check_memory_for_launch

    return check_memory_for_launch(load_recipe(config_and_overrides[0], config_and_overrides[1:]), 1, on_gpu=True)


CHECKS = {
    "env": (check_env, 180),
    "kernel_logprobs": (check_kernel_logprobs, 180),
    "kernel_segment": (check_kernel_segment, 120),
    "kernel_surrogate": (check_kernel_surrogate, 120),
    "engine": (check_engine, 240),
    "fp8_forward": (check_fp8_forward, 240),
    "rl_step_distributed": (lambda a: check_rl_step(a, "distributed"), 300),
    "rl_step_tensor": (lambda a: check_rl_step(a, "tensor"), 300),
    "rl_step_disk": (lambda a: check_rl_step(a, "disk"), 300),
    "memory_plan": (check_memory_plan, 300),
    "rl_step_stress": (check_rl_step_stress, 300),
    "resume_dist_opt": (check_resume_dist_opt, 420),
    "rl_step_ppo_offload": (lambda a: run_rl_steps(a, "tensor", extra=PPO_OFFLOAD, name="ppo_offload")[0], 300),
    "moe_slice": (check_moe_slice, 420),
}


def run_child(args) -> int:
    """One check in this process: prints MARK + the result as the last line."""
    fn, _ = CHECKS[args.child]
    try:
        status, detail = "PASS", fn(args)
    except Skip as err:
        status, detail = "SKIP", str(err)
    except ImportError as err:  # a missing or broken package: name it (and any other missing one) and the fix
        missing = [m for m, _ in missing_imports()] or [err.name or str(err)]
        status, detail = "FAIL", f"{type(err).__name__}: {err}; missing: " + "; ".join(
            f"{m} (install: {install_hint(m)})" for m in missing)
    except AssertionError as err:  # a check's own verdict: its message says what differed
        status, detail = "FAIL", str(err)
    except Exception as err:
        import traceback

        traceback.print_exc()
        status, detail = "FAIL", f"{type(err).__name__}: {err}"
    print(MARK + json.dumps({"status": status, "detail": " ".join(str(detail).split())}), flush=True)
    return 0


def run_check(name: str, args, work: str) -> tuple[str, str, float, list[str]]:
    _, default_timeout = CHECKS[name]
    timeout = args.timeout or default_timeout
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "kernels"),
                                                      os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    env.setdefault("OMP_NUM_THREADS", "2")
    if args.device == "cpu":
        env["TRITON_INTERPRET"] = "1"  # the Triton kernels run interpreted on CPU tensors
    cmd = [sys.executable, __file__, "--child", name, "--device", args.device, "--work", work,
           "--reps", str(args.reps), "--timeout", str(timeout)] + (["--quick"] if args.quick else [])
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "FAIL", f"timed out after {timeout} s (--timeout to change it)", time.perf_counter() - t, []
    seconds = time.perf_counter() - t
    info = [line for line in proc.stdout.splitlines() if line.startswith("  ")]  # the child's report lines
    result = next((line for line in reversed(proc.stdout.splitlines()) if line.startswith(MARK)), None)
    if result is None:  # the child died before reporting (a crash, a kill, an import at start-up)
        tail = " / ".join((proc.stderr or proc.stdout).strip().splitlines()[-4:])
        return "FAIL", f"the check's process exited {proc.returncode} without a result: {tail}", seconds, info
    res = json.loads(result[len(MARK):])
    if res["status"] == "FAIL" and args.verbose:
        info += proc.stderr.splitlines()
    return res["status"], res["detail"], seconds, info


def _in_project_venv() -> bool:
    return sys.prefix != sys.base_prefix


def _stop_reason(status: str, detail: str, args) -> str:
    """Why the other checks would all fail the same way, or "" when they are worth running."""
    if status != "FAIL" and not (args.device == "cuda" and "no CUDA device" in detail):
        return ""
    if status == "FAIL":
        reason = detail
        if not _in_project_venv() and (ROOT / ".venv").is_dir():
            reason += f" and this is {sys.executable}, not the project's virtual environment; " \
                      "run: source .venv/bin/activate (or make setup)"
        return reason
    return "no CUDA device is visible (run with --device cpu for the checks that need none)"


def main(argv: list[str] | None = None) -> int:
    try:
        from sorl_megatron.common.cli_range import DAY, count
    except ModuleNotFoundError:  # this python has not got the project installed: not its environment
        print(f"tools/gpu_check.py: sorl_megatron cannot be imported by {sys.executable}, which is not the project's "
              "virtual environment; run: source .venv/bin/activate (or make setup)", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (default): everything on the GPU; cpu: the checks that need no CUDA")
    parser.add_argument("--quick", action="store_true", help="small shapes and few repeats (the test suite)")
    parser.add_argument("--only", action="append", choices=sorted(CHECKS), help="run only this check (repeatable)")
    parser.add_argument("--timeout", type=count(0, DAY), default=0,
                        help="seconds per check (default: each check's own)")
    parser.add_argument("--reps", type=count(0, 10_000), default=0,
                        help="timed repeats per kernel (default 10, 1 with --quick)")
    parser.add_argument("--work", default=None, help="scratch directory (default: a temporary one)")
    parser.add_argument("--jobs", type=count(1, 64), default=1,
                        help="checks run side by side (default 1: GPU timings want the device alone)")
    parser.add_argument("--verbose", action="store_true", help="print a failed check's traceback")
    parser.add_argument("--keep-going", action="store_true",
                        help="run every check even when the environment check failed (default: stop there, "
                             "since the others would fail the same way)")
    parser.add_argument("--child", choices=sorted(CHECKS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.reps = args.reps or (1 if args.quick or args.device == "cpu" else 10)
    if args.child:
        return run_child(args)
    names = args.only or list(CHECKS)
    print(f"gpu_check: {len(names)} check(s) on {args.device}{' (quick)' if args.quick else ''}", flush=True)
    counts = {"PASS": 0, "FAIL": 0, "SKIP": 0}
    start = time.perf_counter()
    lock = threading.Lock()

    def one(name: str) -> None:
        status, detail, seconds, info = run_check(name, args, work)
        with lock:  # a check's report lines and its result line stay together
            counts[status] += 1
            for line in info:
                print(line, flush=True)
            print(f"{status} {name}: {detail} [{seconds:.0f} s]", flush=True)

    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        work = args.work or tmp
        stopped = False
        if "env" in names and len(names) > 1 and not args.keep_going:
            # the environment first: without CUDA or a package every other check fails the same
            # way, so say it once and stop (a missing package is listed once, above)
            names.remove("env")
            status, detail, seconds, info = run_check("env", args, work)
            counts[status] += 1
            for line in info:
                print(line, flush=True)
            print(f"{status} env: {detail} [{seconds:.0f} s]", flush=True)
            stop = _stop_reason(status, detail, args)
            stopped = bool(stop)
            if stop:
                counts["SKIP"] += len(names)
                print(f"stopped after the environment check: {stop}; the other {len(names)} check(s) were not run "
                      "(--keep-going runs them anyway)", flush=True)
                names = []
        if args.jobs <= 1:
            for name in names:
                one(name)
        else:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(args.jobs) as pool:
                list(pool.map(one, names))
    total = time.perf_counter() - start
    print(f"summary: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped in {total:.0f} s",
          flush=True)
    return 1 if counts["FAIL"] or stopped else 0


if __name__ == "__main__":
    raise SystemExit(main())
