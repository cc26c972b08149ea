"""Tiny models (trained tokenizer + random Qwen3-MoE / Qwen2) and embedded servers, built once."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from sorl_megatron.common.hf_build import HF_BUILD_LOCK
from sorl_megatron.data.tiny_model import TinyModelConfig, save_tiny_model
from sorl_megatron.data.tokenizer import train_tokenizer
from sorl_megatron.sglang_cpu.options import EngineConfig
from sorl_megatron.sglang_cpu.server import start_rollout_server

TEXTS = [
    "<think> I need the capital of France. </think> <search> capital of France </search>",
    "<information> Doc 1(Title: Paris) Paris is the capital of France. </information>",
    "<answer> Paris </answer> The quick brown fox jumps over the lazy dog.",
    "Question: who wrote Hamlet? Answer the question with search and answer tags.",
] * 20 + [f"entity {i} lives in city {i * 7 % 13} and works as role {i % 5}" for i in range(100)]


@pytest.fixture(scope="session")
def tokenizer():
    return train_tokenizer(TEXTS, vocab_size=400)


@pytest.fixture(scope="session")
def moe_dir(tmp_path_factory, tokenizer):
    return save_tiny_model(TinyModelConfig(arch="qwen3_moe", seed=1), tmp_path_factory.mktemp("moe"), tokenizer)


@pytest.fixture(scope="session")
def dense_dir(tmp_path_factory, tokenizer):
    return save_tiny_model(TinyModelConfig(arch="qwen2", seed=2), tmp_path_factory.mktemp("dense"), tokenizer)


@pytest.fixture(scope="session")
def moe_model(moe_dir):
    with HF_BUILD_LOCK:
        return AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def moe_server(moe_dir):
    srv = start_rollout_server(EngineConfig(model_path=str(moe_dir), enable_return_routed_experts=True))
    yield srv
    srv.stop()


def _teacher_forced(model, ids: list[int], temperature: float = 1.0):
    """Per-position log-probs of ``ids[1:]`` and top-k routing ``[len-1, layers, k]``."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_router_logits=getattr(model.config, "num_experts", None) is not None)
    lp = torch.log_softmax(out.logits[0].float() / temperature, -1)[:-1]
    lp = lp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    routing = None
    if getattr(out, "router_logits", None):
        k = model.config.num_experts_per_tok
        routing = torch.stack([torch.topk(torch.softmax(r.float(), -1), k, -1).indices for r in out.router_logits], 1)
        routing = routing[: len(ids) - 1]
    return lp, routing


@pytest.fixture(scope="session")
def teacher_forced():
    return _teacher_forced
