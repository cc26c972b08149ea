"""Throughput of a slice of Qwen3-30B-A3B at its real width: the actor update and the log-prob pass
on one packed micro-batch, the time split by component, grouped expert GEMM on and off.

The slice (``--layers``, 2 by default, up to 4 on an 80 GB GPU): hidden 2048, 128 experts, top-8,
expert FFN 768, 32 query and 4 key/value heads of dim 128, vocabulary 151,936; every layer MoE,
built by this project's bridge from the config (random weights, the TE-less layer spec unless
TransformerEngine imports), bf16 with fp32 main parameters and Adam on CUDA, fp32 on the CPU.
``--small`` is a narrow stand-in with the same structure (hidden 128, 16 experts, top-4, FFN 64,
4 / 2 heads of dim 32, vocabulary 1024, 256 tokens) that the test suite runs on the CPU.

The micro-batch: ``--tokens`` (4,096) packed into one row as seven trajectories of 1/4, 3/16,
5/32, 1/8, 1/8, 3/32 and 1/16 of it (1024 ... 256 tokens), each attending causally to itself.

Timed (median of ``--reps`` after a warm-up; ``torch.cuda.synchronize`` around each on CUDA):

* ``update``: megatron's forward-backward schedule on the micro-batch (the model, the
  vocabulary-parallel log-probs, a PPO loss) and one optimizer step (megatron's Adam, clipping);
* ``logprob``: the forward and the log-probs without gradients;
* the split, each forward + backward on its own at the layer's shapes: ``attention`` (the QKV
  projection with its norm, core attention, the output projection), ``router+dispatch`` (the MoE
  layer minus its experts: routing, permutation, un-permutation), ``experts`` (fc1, SwiGLU, fc2 on
  the routed tokens) per layer, and ``logits+loss`` (output layer, log-probs, loss) once.

Model FLOPs (matmuls only, forward; the backward counts twice the forward: update = 3x, log-prob
= 1x), with T tokens, h hidden, q / kv heads of dim d, E experts, k routed, f expert FFN,
V vocabulary, L layers and packed segment lengths s_i:

    per layer: 2 T h d (q + 2 kv)  +  2 T q d h  +  2 q d sum_i s_i^2  +  2 T h E  +  6 T k h f
               (QKV, output projection, causal scores and values: half of 4 s^2 q d each, router,
               the experts' fc1 (2f) and fc2)
    model:     L * per layer  +  2 T h V  (logits)

``model TFLOPS`` = these FLOPs over the measured time; tokens/s = T over it.

    python benchmarks/bench_moe_slice.py [--layers 2] [--tokens 4096] [--reps 5]   # on a GPU
    python benchmarks/bench_moe_slice.py --small --reps 1                        # the suite's CPU run
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sorl_megatron.bridge.grouped_gemm import ENV as GEMM_ENV  # noqa: E402


@dataclass(frozen=True)
class Shape:
    hidden: int = 2048
    experts: int = 128
    topk: int = 8
    ffn: int = 768
    heads: int = 32
    kv: int = 4
    head_dim: int = 128
    vocab: int = 151936
    layers: int = 2
    tokens: int = 4096


SMALL = Shape(hidden=128, experts=16, topk=4, ffn=64, heads=4, kv=2, head_dim=32, vocab=1024, tokens=256)
SEGMENTS = (8, 6, 5, 4, 4, 3, 2)  # thirty-seconds of the row


def segment_lengths(tokens: int) -> list[int]:
    lengths = [tokens * s // 32 for s in SEGMENTS]
    lengths[-1] += tokens - sum(lengths)
    return lengths


def model_flops(s: Shape, lengths: list[int]) -> dict[str, float]:
    """Forward FLOPs of each component for one micro-batch (the docstring's formula)."""
    t, h, d = s.tokens, s.hidden, s.head_dim
    attention = 2 * t * h * d * (s.heads + 2 * s.kv) + 2 * t * s.heads * d * h
    attention += 2 * s.heads * d * sum(n * n for n in lengths)
    router, experts = 2 * t * h * s.experts, 6 * t * s.topk * h * s.ffn
    out = {"attention": attention, "router+dispatch": router, "experts": experts, "logits+loss": 2 * t * h * s.vocab}
    out["model"] = s.layers * (attention + router + experts) + out["logits+loss"]
    return out


def hf_config(s: Shape):
    from sorl_megatron.data.tiny_model import TinyModelConfig, hf_config

    tiny = TinyModelConfig(arch="qwen3_moe", vocab_size=s.vocab, hidden_size=s.hidden, num_layers=s.layers,
                           num_heads=s.heads, num_kv_heads=s.kv, head_dim=s.head_dim, intermediate_size=s.ffn,
                           num_experts=s.experts, top_k=s.topk, max_position_embeddings=max(4096, s.tokens))
    return hf_config(tiny)


class Slice:
    """The model, its optimizer and one packed micro-batch on the device."""

    def __init__(self, s: Shape, device: torch.device):
        from sorl_megatron.bridge.build import build_model
        from sorl_megatron.bridge.model import ModelOptions
        from sorl_megatron.bridge.parallel import init_distributed
        from sorl_megatron.engine.config import OptimConfig
        from sorl_megatron.engine.optimizer import OptimizerStep

        init_distributed()
        self.shape, self.device = s, device
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        ddp = dict(use_distributed_optimizer=True, grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                   overlap_param_gather=False)
        overrides = dict(moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none")
        options = ModelOptions(dtype=dtype, wrap_with_ddp=True, ddp_config=ddp, config_overrides=overrides)
        self.model = build_model(hf_config(s), options=options, load_weights=False)
        self.stepper = OptimizerStep(OptimConfig(lr=1e-6, clip_grad=1.0), self.model)
        self.gpt = self.model.unwrapped()[0]
        self.lengths = segment_lengths(s.tokens)
        self._batch(dtype)

    def _batch(self, dtype) -> None:
        from megatron.core.packed_seq_params import PackedSeqParams

        from sorl_megatron.bridge.local_spec import PLAN_ATTR, build_attention_plan

        s, dev = self.shape, self.device
        g = torch.Generator().manual_seed(0)
        cu = torch.tensor([0, *torch.tensor(self.lengths).cumsum(0).tolist()], dtype=torch.int32)
        self.ids = torch.randint(0, s.vocab, (1, s.tokens), generator=g).to(dev)
        self.pos = torch.cat([torch.arange(n) for n in self.lengths]).unsqueeze(0).to(dev)
        self.params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu.to(dev), cu_seqlens_kv=cu.to(dev),
                                      max_seqlen_q=max(self.lengths), max_seqlen_kv=max(self.lengths))
        setattr(self.params, PLAN_ATTR, build_attention_plan(cu, dev))  # as the engine's MicroBatcher does
        self.targets = torch.roll(self.ids, -1, dims=1)
        self.old = (-torch.rand(1, s.tokens, generator=g) * 3).to(dev)
        self.adv = torch.randn(1, s.tokens, generator=g).to(dev)
        self.mask = torch.ones(1, s.tokens, dtype=torch.long, device=dev)
        self.hidden = torch.randn(s.tokens, 1, s.hidden, generator=g).to(dev, dtype)

    def loss(self, logits: torch.Tensor) -> torch.Tensor:
        from sorl_megatron.algorithms import PolicyLossConfig, compute_policy_loss
        from sorl_megatron.engine.vocab_parallel import vocab_parallel_logprobs_entropy

        lp, _ = vocab_parallel_logprobs_entropy(logits, self.targets)
        loss, _ = compute_policy_loss(lp, self.old, self.adv, self.mask, PolicyLossConfig(name="ppo"), normalize=False)
        return loss

    def update(self) -> None:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def step(data_iterator, model):
            next(data_iterator)
            out = model(self.ids, self.pos, None, packed_seq_params=self.params)
            return out, lambda output: (self.loss(output), {})

        self.stepper.zero_grads()
        get_forward_backward_func()(forward_step_func=step, data_iterator=iter([None]), model=self.model.chunks[0],
                                    num_microbatches=1, seq_length=self.shape.tokens, micro_batch_size=1,
                                    forward_only=False)
        self.stepper.step()

    @torch.no_grad()
    def logprob(self) -> None:
        from sorl_megatron.engine.vocab_parallel import vocab_parallel_logprobs_entropy

        vocab_parallel_logprobs_entropy(self.model.chunks[0](self.ids, self.pos, None, packed_seq_params=self.params),
                                        self.targets)

    # -- the split: each part forward + backward on its own --------------------------------

    def _fwd_bwd(self, fn, *inputs) -> None:
        leaves = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs]
        out = fn(*leaves)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(torch.ones_like(out))

    def attention(self) -> None:
        att = self.gpt.decoder.layers[0].self_attention
        self._fwd_bwd(lambda x: att(x, None, packed_seq_params=self.params), self.hidden)

    def moe(self) -> None:
        self._fwd_bwd(self.gpt.decoder.layers[0].mlp, self.hidden)

    def expert_inputs(self) -> tuple:
        """The experts' inputs in one MoE forward (routed tokens, tokens per expert, probabilities)."""
        experts, seen = self.gpt.decoder.layers[0].mlp.experts, {}
        handle = experts.register_forward_pre_hook(lambda mod, args: seen.setdefault("args", args))
        with torch.no_grad():
            self.gpt.decoder.layers[0].mlp(self.hidden)
        handle.remove()
        return seen["args"]

    def experts(self, args: tuple) -> None:
        x, counts, probs = args
        self._fwd_bwd(lambda a, p: self.gpt.decoder.layers[0].mlp.experts(a, counts, p), x, probs)

    def logits_loss(self) -> None:
        out = self.gpt.output_layer
        self._fwd_bwd(lambda x: self.loss(out(x)[0].transpose(0, 1)), self.hidden)


def timed(fn, reps: int, device: torch.device) -> float:
    """Median seconds of ``fn`` over ``reps`` after one warm-up."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@contextlib.contextmanager
def expert_gemm(mode: str):
    old = os.environ.get(GEMM_ENV)
    os.environ[GEMM_ENV] = mode
    try:
        yield
    finally:
        os.environ.pop(GEMM_ENV) if old is None else os.environ.__setitem__(GEMM_ENV, old)


@contextlib.contextmanager
def counting_grouped_kernel(calls: list):
    """Counts ``torch._grouped_mm`` calls (0 when the experts loop, or under TE's spec)."""
    kernel = getattr(torch, "_grouped_mm", None)
    if kernel is None:
        yield
        return

    def counted(*args, **kwargs):
        calls.append(1)
        return kernel(*args, **kwargs)

    torch._grouped_mm = counted
    try:
        yield
    finally:
        torch._grouped_mm = kernel


def measure(sl: Slice, reps: int) -> dict[str, dict[str, float]]:
    """Seconds per part, per expert-GEMM mode (attention and logits do not depend on it), and
    the grouped kernel's calls in each mode's runs."""
    dev = sl.device
    shared = {"attention": timed(sl.attention, reps, dev), "logits+loss": timed(sl.logits_loss, reps, dev)}
    args = sl.expert_inputs()
    out = {}
    for mode in ("grouped", "loop"):
        calls: list = []
        with expert_gemm(mode), counting_grouped_kernel(calls):
            t = dict(shared, update=timed(sl.update, reps, dev), logprob=timed(sl.logprob, reps, dev))
            t["experts"] = timed(lambda: sl.experts(args), reps, dev)
            t["router+dispatch"] = max(timed(sl.moe, reps, dev) - t["experts"], 0.0)
        out[mode] = dict(t, grouped_calls=len(calls))
    return out


def report(times: dict[str, dict[str, float]], s: Shape, lengths: list[int]) -> None:
    flops = model_flops(s, lengths)
    work = {"update": 3 * flops["model"], "logprob": flops["model"],
            **{k: 3 * flops[k] for k in ("attention", "router+dispatch", "experts", "logits+loss")}}
    for mode, t in times.items():
        print(f"\nexpert GEMM {mode} (torch._grouped_mm calls: {t['grouped_calls']}):")
        print(f"  {'part':18s} {'ms':>10s} {'tokens/s':>12s} {'model TFLOPS':>13s}")
        for part in ("update", "logprob", "attention", "router+dispatch", "experts", "logits+loss"):
            sec = t[part]
            rate = s.tokens / sec if sec > 0 else float("inf")
            tflops = work[part] / sec / 1e12 if sec > 0 else float("inf")
            print(f"  {part:18s} {sec * 1e3:10.2f} {rate:12.0f} {tflops:13.3f}")
        layers = s.layers * (t["attention"] + t["router+dispatch"] + t["experts"])
        print(f"  split: {s.layers} x (attention + router+dispatch + experts) = {layers * 1e3:.2f} ms, "
              f"logits+loss {t['logits+loss'] * 1e3:.2f} ms, update {t['update'] * 1e3:.2f} ms")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="the narrow CPU stand-in (the test suite's run)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=0, help="packed micro-batch tokens (default 4096; 256 --small)")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    base = SMALL if args.small else Shape()
    s = Shape(**{**base.__dict__, "layers": args.layers, "tokens": args.tokens or base.tokens})
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    load = os.getloadavg()[0]
    from sorl_megatron.bridge.local_spec import transformer_engine_available

    spec = "TransformerEngine's (the expert GEMM modes do not apply)" if transformer_engine_available() else "local"
    print(f"bench_moe_slice: {s} on {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}; "
          f"load {load:.2f} on {os.cpu_count()} cores; segments {segment_lengths(s.tokens)}; layer spec {spec}")
    sl = Slice(s, device)
    report(measure(sl, args.reps), s, sl.lengths)


if __name__ == "__main__":
    main()
