"""Tiny random HF checkpoints built from configs (nothing is downloaded)."""

from __future__ import annotations

import os
from typing import Callable

import torch

from sorl_megatron.bridge.families import FAMILIES, tiny_base
from sorl_megatron.common.hf_build import HF_BUILD_LOCK

VOCAB = tiny_base()["vocab_size"]  # 128

_common = tiny_base  # the sizes every tiny model shares (tests/engine/test_memory_plan.py builds one more)

# Each family's tiny config is its spec's (sorl_megatron/bridge/families/<model_type>.py).
qwen2_config = FAMILIES["qwen2"].tiny_config
qwen3_config = FAMILIES["qwen3"].tiny_config
llama_config = FAMILIES["llama"].tiny_config
qwen3_moe_config = FAMILIES["qwen3_moe"].tiny_config
mixtral_config = FAMILIES["mixtral"].tiny_config
deepseek_v3_config = FAMILIES["deepseek_v3"].tiny_config
qwen2_moe_config = FAMILIES["qwen2_moe"].tiny_config
glm4_moe_config = FAMILIES["glm4_moe"].tiny_config


def deepseek_v3_yarn_config():
    """DeepSeek-V3 with the released checkpoints' YaRN rope scaling (factor 4 over 32 positions)."""
    cfg = deepseek_v3_config()
    cfg.rope_parameters = {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
    }
    return cfg


def deepseek_v3_no_q_lora_config():
    """MLA without the q LoRA (q_lora_rank=None: one q projection, as DeepSeek-V2-Lite)."""
    cfg = deepseek_v3_config()
    cfg.q_lora_rank = None
    return cfg


def deepseek_v3_3l_config():
    """Three layers (a prime count, as DeepSeek-V3's 61): only uneven pipeline stages split it,
    e.g. the dense layer 0 alone on the first stage and the two MoE layers on the second."""
    cfg = deepseek_v3_config()
    cfg.num_hidden_layers = 3
    return cfg


CONFIGS: dict[str, Callable] = {
    "qwen2": lambda: qwen2_config(tied=False),
    "qwen2_tied": lambda: qwen2_config(tied=True),
    "qwen2_4l": lambda: qwen2_config(tied=True, layers=4),  # for PP x VPP
    "qwen2_bf16": lambda: qwen2_config(tied=False),  # saved in bfloat16, like real checkpoints
    "qwen3_moe": qwen3_moe_config,
    "mixtral": mixtral_config,
    "deepseek_v3": deepseek_v3_config,
    "deepseek_v3_yarn": deepseek_v3_yarn_config,
    "deepseek_v3_no_q_lora": deepseek_v3_no_q_lora_config,
    "deepseek_v3_3l": deepseek_v3_3l_config,  # uneven PP
    "qwen2_moe": qwen2_moe_config,
    "glm4_moe": glm4_moe_config,
    # appended last: conftest seeds each model by its position here
    "qwen3": qwen3_config,
    "llama": llama_config,
    # then every other registered family, by its spec's tiny config
}
CONFIGS.update({mt: spec.tiny_config for mt, spec in FAMILIES.items() if mt not in CONFIGS})


# The issue-20 families get routers with clear top-k margins (FamilySpec.tiny_router_std); the
# older kinds keep their default-initialized routers (other tests' tolerances were measured on
# those exact models).


def _random_norm_or_bias(name: str, p: torch.Tensor) -> bool:
    """Random (not default-initialized) norms, so a norm loaded into the wrong slot shows up, and
    biases; False (nothing drawn) for any other tensor."""
    if "norm" in name:
        p.uniform_(0.5, 1.5)
        return True
    if name.endswith("bias"):
        p.normal_(0.0, 0.1)
        return True
    return False


def save_tiny_model(kind: str, out_dir: str, seed: int = 0, with_tokenizer: bool = True) -> str:
    """Create a random `kind` model in float32 and save_pretrained it to out_dir."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = CONFIGS[kind]()
    with HF_BUILD_LOCK:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if _random_norm_or_bias(name, p):
                continue
            router_std = FAMILIES[config.model_type].tiny_router_std
            if name.endswith("mlp.gate.weight") and router_std is not None:
                p.normal_(0.0, router_std)  # clear top-k margins (no near-ties between HF and Megatron)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # sigmoid routers' load-balancing bias
                buf.normal_(0.0, 0.1)
    if kind.endswith("_bf16"):
        model = model.to(torch.bfloat16)
    model.save_pretrained(out_dir)
    if getattr(config, "num_nextn_predict_layers", 0):
        _add_mtp_weights(config, out_dir)
    if with_tokenizer:
        _write_tokenizer(out_dir)
    return out_dir


def save_large_logit_model(out_dir: str, seed: int = 0) -> str:
    """A tiny Qwen2 (hidden 128, 2 layers) whose logits reach ~13, as a trained model's do:
    random weights at three times unit gain. Its float32 megatron vs transformers noise is
    ~3e-5 in absolute terms (above the 1e-5 absolute bound verify used to apply), 2e-6 relative."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = qwen2_config(hidden_size=128, intermediate_size=256)
    with HF_BUILD_LOCK:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not _random_norm_or_bias(name, p):
                p.normal_(0.0, 3.0 / p.shape[-1] ** 0.5)
    model.save_pretrained(out_dir)
    _write_tokenizer(out_dir)
    return out_dir


def mtp_weight_names(config) -> list[str]:
    """The tensors a DeepSeek-V3 / GLM-4.5 checkpoint stores for its MTP module (layer index
    num_hidden_layers): transformers ignores them, and so must the Megatron loader."""
    i = config.num_hidden_layers
    return [f"model.layers.{i}.{n}" for n in (
        "enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "input_layernorm.weight",
        "self_attn.o_proj.weight", "mlp.gate.weight", "mlp.experts.0.down_proj.weight",
    )]


def _add_mtp_weights(config, out_dir: str) -> None:
    from safetensors.torch import load_file, save_file

    path = os.path.join(out_dir, "model.safetensors")
    state = load_file(path)
    for name in mtp_weight_names(config):
        state[name] = torch.randn(8, 8)
    save_file(state, path, metadata={"format": "pt"})


def _write_tokenizer(out_dir: str) -> None:
    """A word-level tokenizer over VOCAB tokens: enough to check that files are copied."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB - 1)}
    vocab["<unk>"] = VOCAB - 1
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(out_dir)


def hf_logits(model_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    with HF_BUILD_LOCK:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(tokens).logits.float()


if __name__ == "__main__":
    import sys

    save_tiny_model(sys.argv[1], sys.argv[2])
    print(os.listdir(sys.argv[2]))


def copy_model_dir(src: str, dst: str) -> str:
    import shutil

    if os.path.exists(dst):
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    return dst
