"""SGLang's own weight loaders, run on CPU: what a rollout server does with one weight-update
request of HF-named tensors.

A request (one ``/update_weights_from_distributed`` bucket, one ``/update_weights_from_tensor``
body, one ``/update_weights_from_disk``) is one call of the model's ``load_weights`` (SGLang
0.5.21, ``model_runner_components/weight_updater.py``). Those functions are taken from the wheel
that ``requirements-sglang.txt`` pins (tests/sglang_wheel.py fetches it), out of their modules
with ``ast``, and executed here with the module-level names they read: the pure-Python helpers
they call come from the same wheel (``get_layer_id``, ``FusedMoE.make_expert_params_mapping``,
``should_async_load``, ``maybe_executor_submit``, the environment flags' defaults, ...); only the
model object around them is ours (:class:`Receiver`): its parameters record each
``weight_loader`` call instead of copying into GPU memory, and a tensor is a meta tensor of the
sent shape and dtype. ``torch.cat`` is torch's, noting which sent tensors it joined.

What SGLang holds (its parameter names) cannot be read without building its model, which needs
CUDA: :func:`receiver_params` derives them from an HF checkpoint's names with the loader's own
tables (stacked and expert mappings, DeepSeek's fused ``q_a_proj`` / ``kv_a_proj_with_mqa``),
and loading that whole checkpoint in one call through SGLang's code must then reach every name
(``test_receiver_rules.py`` checks it). FP8 servers hold a ``weight_scale_inv`` beside each
block-quantized weight: which modules SGLang quantizes is read from the model file's linear
constructions (:func:`quantized_modules`).
"""

from __future__ import annotations
import __future__

import ast
import concurrent.futures
import logging
import re
import types
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Iterable, Optional

import torch

from tests import sglang_wheel

LINEAR = "sglang/srt/layers/linear.py"
FP8 = "sglang/srt/layers/quantization/fp8.py"
ENVIRON = "sglang/srt/environ.py"
UPDATER = "sglang/srt/model_executor/model_runner_components/weight_updater.py"

# model_type -> (model file, loader class, loader function, modules whose linears are built there)
FAMILIES = {
    "qwen2": ("sglang/srt/models/qwen2.py", "Qwen2ForCausalLM", "_legacy_load_weights"),
    "qwen3_moe": ("sglang/srt/models/qwen3_moe.py", "Qwen3MoeForCausalLM", "load_weights"),
    "deepseek_v3": ("sglang/srt/models/deepseek_common/deepseek_weight_loader.py", "DeepseekV2WeightLoaderMixin",
                    "do_load_weights"),
}
MODEL_FILES = {"qwen2": "sglang/srt/models/qwen2.py", "qwen3_moe": "sglang/srt/models/qwen3_moe.py",
               "deepseek_v3": "sglang/srt/models/deepseek_v2.py"}


# ---------------------------------------------------------------------------------------------
# reading the wheel


def _compile(src: str, ns: dict) -> None:
    flags = __future__.annotations.compiler_flag  # annotations name types we do not supply
    exec(compile(src, "<sglang>", "exec", flags=flags, dont_inherit=True), ns)


def top_level(module_source: str, *names: str) -> str:
    """The source of top-level functions, classes and assignments named ``names``."""
    out, found = [], set()
    for node in ast.parse(module_source).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in names:
            deco = "".join(f"@{ast.get_source_segment(module_source, d)}\n" for d in node.decorator_list)
            out.append(deco + ast.get_source_segment(module_source, node))
            found.add(node.name)
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id in names for t in node.targets):
            out.append(ast.get_source_segment(module_source, node))
            found.update(t.id for t in node.targets if isinstance(t, ast.Name))
    missing = set(names) - found
    if missing:
        raise LookupError(f"not found in the wheel's module: {sorted(missing)}")
    return "\n\n".join(out)


def function(module: str, name: str, cls: Optional[str] = None, ns: Optional[dict] = None):
    """Function ``name`` (a method of ``cls``) of wheel module ``module``, compiled in ``ns``."""
    ns = {} if ns is None else ns
    _compile(sglang_wheel.function_source(sglang_wheel.source(module), name, cls=cls), ns)
    return ns[name]


class _Flag:
    def __init__(self, default: Any):
        self.default = default

    def get(self) -> Any:
        return self.default


def env_defaults() -> SimpleNamespace:
    """SGLang's environment flags (``envs.X.get()``) at their defaults, read from environ.py."""
    src = sglang_wheel.source(ENVIRON)
    cls = next(n for n in ast.parse(src).body if isinstance(n, ast.ClassDef) and n.name == "Envs")
    flags = {}
    for item in cls.body:
        if (isinstance(item, ast.Assign) and len(item.targets) == 1 and isinstance(item.targets[0], ast.Name)
                and isinstance(item.value, ast.Call) and item.value.args):
            try:
                flags[item.targets[0].id] = _Flag(ast.literal_eval(item.value.args[0]))
            except ValueError:  # a computed default (platform-dependent): unknown here
                flags[item.targets[0].id] = _Flag(None)
    return SimpleNamespace(**flags)


def helpers() -> dict:
    """The wheel's helpers the loaders call, and the names they read, as the loaders' globals."""
    ns: dict = {"re": re, "torch": torch, "concurrent": concurrent, "logging": logging, "dataclass": dataclass}
    layer_utils = sglang_wheel.source("sglang/srt/layers/utils/common.py")
    _compile(top_level(layer_utils, "get_layer_id"), ns)
    loader_utils = sglang_wheel.source("sglang/srt/model_loader/utils.py")
    _compile(top_level(loader_utils, "should_async_load", "maybe_executor_submit"), ns)
    weight_utils = sglang_wheel.source("sglang/srt/model_loader/weight_utils.py")
    _compile(top_level(weight_utils, "RUNAI_STREAMER_TENSOR_ATTR"), ns)
    mapping = function("sglang/srt/layers/moe/fused_moe_triton/layer.py", "make_expert_params_mapping",
                       cls="FusedMoE")
    ns["FusedMoE"] = type("FusedMoE", (), {"make_expert_params_mapping": classmethod(mapping)})
    ns["envs"] = env_defaults()
    ns["logger"] = logging.getLogger("sglang_loaders")
    ns["log_info_on_rank0"] = lambda logger, msg: logger.info(msg)
    ns["add_prefix"] = lambda name, prefix: name if not prefix else f"{prefix}.{name}"
    ns["_is_npu"] = False  # the platform: a CUDA server
    return ns


# ---------------------------------------------------------------------------------------------
# the receiving model


@dataclass(frozen=True)
class Load:
    """One ``weight_loader`` call: the parameter, its shard and expert, and the sent names whose
    tensors it wrote."""

    param: str
    shard: Any
    expert: Optional[int]
    sources: tuple[str, ...]

    @property
    def unit(self) -> tuple[str, Any, Optional[int]]:
        return self.param, self.shard, self.expert


class _Param:
    def __init__(self, name: str, receiver: "Receiver"):
        self.name, self.receiver = name, receiver

    def weight_loader(self, param, loaded_weight, *args, **kwargs):
        shard = kwargs.get("shard_id", args[0] if args and not kwargs else None)
        self.receiver._record(Load(self.name, shard, kwargs.get("expert_id"), self.receiver._sources(loaded_weight)))


class _LazyValue:  # qwen3_moe's, for a value the loader stores and never reads here
    def __init__(self, fn):
        self.fn = fn


@dataclass
class Receiver:
    """One SGLang server's model, as its loader sees it: ``load(named)`` is one request."""

    hf_config: Any
    params: set[str]
    quantized: bool = False
    fused_shared_experts: int = 0
    loads: list[Load] = field(default_factory=list)

    def __post_init__(self):
        mt = self.hf_config.model_type
        module, cls, name = FAMILIES[mt]
        ns = helpers()
        src = sglang_wheel.source(module)
        torch_ns = types.ModuleType("torch")
        torch_ns.__getattr__ = lambda attr: getattr(torch, attr)
        torch_ns.cat = self._cat
        ns["torch"] = torch_ns
        if mt == "qwen2":
            v2 = env_defaults().SGLANG_ENABLE_WEIGHT_LOADER_V2.get()
            assert v2 is False, "SGLang's default Qwen2 loader is its v2 one now: run that"
            ns["default_weight_loader"] = None
        elif mt == "qwen3_moe":
            ns.update(LazyValue=_LazyValue, Qwen3MoeSparseMoeBlock=None)
        else:
            _compile(top_level(src, "NVFP4_CKPT_FP8_ATTN_QUANT_MODULES", "_clone_if_runai_streamed_tensor",
                               "_get_indexer_weight_block_size", "_load_fused_indexer_wk", "_load_fused_expert_tensor",
                               "NextNEnabledConfig", "NextNDisabledConfig"), ns)
            ns["NextNConfig"] = ns["NextNEnabledConfig"] | ns["NextNDisabledConfig"]
            # a type test against quantization classes this harness never builds (W4A-FP8 checkpoints)
            ns["is_wint4afp8_or_wint4a16_config"] = lambda quant_config: False
            ns["enable_nextn_moe_bf16_cast_to_fp8"] = lambda quant_config: False
        ns["default_weight_loader"] = None  # every parameter here has its own weight_loader
        methods = {name: function(module, name, cls=cls, ns=ns)}
        if mt == "deepseek_v3":
            for extra in ("_initialize_nextn_conf", "_maybe_quant_weights_to_fp8_ue8m0"):
                methods[extra] = function(module, extra, cls=cls, ns=ns)
        self._fn = methods[name]
        layers = int(self.hf_config.num_hidden_layers)
        self._self = type("SGLangModel", (), {
            **methods,
            "named_parameters": lambda _: [(p, _Param(p, self)) for p in sorted(self.params)],
            # kv_b_proj's post-processing (w_kc / w_vc on the GPU): nothing to record
            "post_load_weights": lambda _, is_nextn=False, weight_names=None: None,
        })()
        quant = SimpleNamespace(get_name=lambda: "fp8", weight_block_size=[128, 128]) if self.quantized else None
        model = SimpleNamespace(start_layer=0, end_layer=layers)
        vars(self._self).update(config=self.hf_config, quant_config=quant, model=model,
                                pp_group=SimpleNamespace(is_last_rank=True, is_first_rank=True),
                                num_fused_shared_experts=self.fused_shared_experts)
        self._names: dict[int, tuple[str, ...]] = {}

    def _cat(self, tensors, dim=0):
        out = torch.cat(tensors, dim)
        self._names[id(out)] = tuple(n for t in tensors for n in self._sources(t))
        self._keep.append(out)
        return out

    def _sources(self, tensor) -> tuple[str, ...]:
        return self._names.get(id(tensor), ())

    def _record(self, load: Load) -> None:
        self.loads.append(load)

    def load(self, named: Iterable[tuple[str, torch.Tensor]]) -> list[Load]:
        """One request: SGLang's ``load_weights`` over ``named``; returns the loads it made."""
        named = list(named)
        self._keep = [t for _, t in named]
        self._names = {id(t): (n,) for n, t in named}
        start = len(self.loads)
        self._fn(self._self, iter(named))
        return self.loads[start:]


def meta(shape, dtype) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=getattr(torch, dtype) if isinstance(dtype, str) else dtype, device="meta")


# ---------------------------------------------------------------------------------------------
# what SGLang holds


def loader_tables(model_type: str) -> dict:
    """The loader's renaming tables as the wheel states them: ``stacked`` (param, shard name,
    shard id), the expert mapping's call arguments, and DeepSeek's fused a-projections."""
    module, cls, name = FAMILIES[model_type]
    src = sglang_wheel.function_source(sglang_wheel.source(module), name, cls=cls)
    tree = ast.parse(src)
    tables: dict = {"stacked": [], "experts": None, "fused_a": None}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "stacked_params_mapping"
                                                for t in node.targets):
            tables["stacked"] = ast.literal_eval(node.value)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "make_expert_params_mapping"):
            tables["experts"] = {k.arg: ast.literal_eval(k.value) for k in node.keywords
                                 if isinstance(k.value, ast.Constant)}
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "replace"
                and len(node.args) == 2 and all(isinstance(a, ast.Constant) for a in node.args)
                and "fused" in node.args[1].value):
            tables["fused_a"] = tables["fused_a"] or {}
            tables["fused_a"][node.args[0].value] = node.args[1].value
    return tables


def receiver_params(hf_config, names: Iterable[str], fused_shared_experts: int = 0) -> set[str]:
    """SGLang's parameter names for a checkpoint of ``names``, by the loader's tables
    (:func:`loader_tables`), in the order its loop tries them."""
    mt = hf_config.model_type
    t = loader_tables(mt)
    experts = 0
    if t["experts"] is not None:
        experts = int(getattr(hf_config, "num_experts", None) or getattr(hf_config, "n_routed_experts"))
    mapping = []
    if experts:
        make = helpers()["FusedMoE"].make_expert_params_mapping
        kw = {k: v for k, v in t["experts"].items() if k != "num_experts"}
        mapping = make(num_experts=experts + fused_shared_experts, **kw)
    fuse_a = t["fused_a"] if getattr(hf_config, "q_lora_rank", None) is not None else None
    out = set()
    for name in names:
        if fused_shared_experts and "mlp.shared_experts" in name:
            name = name.replace("mlp.shared_experts", f"mlp.experts.{hf_config.n_routed_experts}")
        out.add(_destination(name, t["stacked"], mapping, fuse_a))
    return out


def _destination(name: str, stacked, mapping, fuse_a) -> str:
    for param, shard_name, _ in stacked:
        if shard_name in name and "mlp.experts" not in name:
            return name.replace(shard_name, param)
    for param, weight_name, _, _ in mapping:
        if weight_name in name:
            return name.replace(weight_name, param)
    for member, fused in (fuse_a or {}).items():
        if member in name:
            return name.replace(member, fused)
    return name


def linear_classes() -> set[str]:
    """SGLang's ``LinearBase`` and its subclasses (layers/linear.py)."""
    tree = ast.parse(sglang_wheel.source(LINEAR))
    bases = {n.name: [b.id for b in n.bases if isinstance(b, ast.Name)]
             for n in tree.body if isinstance(n, ast.ClassDef)}
    out = {"LinearBase"}
    changed = True
    while changed:
        changed = False
        for name, parents in bases.items():
            if name not in out and out & set(parents):
                out.add(name)
                changed = True
    return out


def quantized_modules(model_type: str) -> dict[str, bool]:
    """Per module attribute (``q_b_proj``, ``gate``, ``experts``, ...): whether an FP8 server
    quantizes it. Read from the model file's constructions ``self.<attr> = <Linear>(...,
    quant_config=<expr>)`` (and the MoE experts'), ``<expr>`` evaluated with an FP8 config, the
    function's own assignments before it and the class's static methods; SGLang's Fp8 config
    quantizes a linear or MoE layer built with a config (``get_quant_method``), a block-FP8
    linear holding ``weight_scale_inv`` (fp8.py)."""
    assert 'register_parameter("weight_scale_inv"' in sglang_wheel.source(FP8)
    src = sglang_wheel.source(MODEL_FILES[model_type])
    linear = linear_classes()
    fp8 = SimpleNamespace(get_name=lambda: "fp8", weight_block_size=[128, 128])
    envs = env_defaults()
    out: dict[str, bool] = {}
    for cls in (n for n in ast.parse(src).body if isinstance(n, ast.ClassDef)):
        statics = {}
        for m in cls.body:
            if isinstance(m, ast.FunctionDef) and any(isinstance(d, ast.Name) and d.id == "staticmethod"
                                                        for d in m.decorator_list):
                ns = {"envs": envs}
                _compile(ast.get_source_segment(src, m), ns)
                statics[m.name] = ns[m.name]
        for fn in (m for m in cls.body if isinstance(m, ast.FunctionDef) and m.name == "__init__"):
            local: dict = {"quant_config": fp8, "None": None, "self": SimpleNamespace(**statics)}
            for node in ast.walk(fn):
                if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                    try:
                        local[node.targets[0].id] = eval(compile(ast.Expression(node.value), "<sglang>", "eval"),
                                                         {"quant_config": fp8}, dict(local))
                    except Exception:
                        pass  # a value this reading does not need
                if not (isinstance(node, ast.Assign) and len(node.targets) == 1
                        and isinstance(node.targets[0], ast.Attribute)
                        and isinstance(node.targets[0].value, ast.Name) and node.targets[0].value.id == "self"
                        and isinstance(node.value, ast.Call)):
                    continue
                attr, call = node.targets[0].attr, node.value
                func = call.func
                is_linear = isinstance(func, ast.Name) and func.id in linear
                is_moe = attr == "experts"
                kw = next((k.value for k in call.keywords if k.arg == "quant_config"), None)
                if not (is_linear or is_moe) or kw is None:
                    continue
                value = eval(compile(ast.Expression(kw), "<sglang>", "eval"), {}, dict(local))
                quantized = value is not None
                if out.get(attr, quantized) != quantized:
                    raise AssertionError(f"{attr} is built both quantized and not in {MODEL_FILES[model_type]}")
                out[attr] = quantized
    return out


def fp8_params(params: set[str], quantized: dict[str, bool]) -> set[str]:
    """The scales an FP8 server holds beside ``params``: ``<module>.weight_scale_inv`` of each
    quantized linear, ``experts.w13_weight_scale_inv`` / ``w2_`` of quantized experts."""
    out = set()
    for p in params:
        m = re.search(r"\.([A-Za-z0-9_]+)\.weight$", p)
        if m and quantized.get(m.group(1)) and ".layers." in p:
            out.add(p + "_scale_inv")
        m = re.search(r"\.experts\.(w13|w2)_weight$", p)
        if m and quantized.get("experts"):
            out.add(p + "_scale_inv")
    return out


# ---------------------------------------------------------------------------------------------
# an HF checkpoint's names, as transformers defines the model


def checkpoint_names(hf_config) -> list[tuple[str, tuple[int, ...]]]:
    """The tensors of an HF checkpoint of ``hf_config``: transformers' model built on the meta
    device, its state dict without tied copies, and transformers' own checkpoint conversion
    (``conversion_mapping``) undone where it merges per-expert tensors into one."""
    from transformers import AutoModelForCausalLM
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    state = model.state_dict()
    unique = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    if getattr(hf_config, "tie_word_embeddings", False):
        unique.discard("lm_head.weight")
    converters = [c for c in (get_checkpoint_conversion_mapping(hf_config.model_type) or [])
                  if type(c).__name__ == "WeightConverter"]
    out = []
    for name, t in state.items():
        if name not in unique:
            continue
        conv = next((c for c in converters for tgt in _patterns(c.target_patterns) if name.endswith(tgt)), None)
        if conv is None:
            out.append((name, tuple(t.shape)))
            continue
        ops = [type(o).__name__ for o in conv.operations]
        sources = _patterns(conv.source_patterns)
        tgt = next(p for p in _patterns(conv.target_patterns) if name.endswith(p))
        if ops[0] != "MergeModulelist" or ops[1:] not in ([], ["Concatenate"]):
            raise NotImplementedError(f"conversion {ops} of {name}")
        per_expert = list(t.shape[1:])
        if ops[1:]:
            d = conv.operations[1].dim - 1
            per_expert[d] //= len(sources)
        prefix = name[: -len(tgt)]
        for e in range(t.shape[0]):
            for src in sources:
                out.append((prefix + src.replace("*", str(e)), tuple(per_expert)))
    return out


def _patterns(p) -> list[str]:
    return [p] if isinstance(p, str) else list(p)
