"""Checkpoint conversion CLI (`python tools/convert.py ...` or
`python -m sorl_megatron.bridge.convert_cli ...`), single-process or under torchrun.

  hf-to-megatron  HF directory -> Megatron distributed checkpoint at a chosen layout
  megatron-to-hf  Megatron checkpoint (or HF directory) -> HF directory, fp32/bf16 or FP8
  verify          the model's weights vs the HF directory's (bit for bit), and transformers logits vs
                  Megatron logits on random tokens (within a bound relative to the logits' scale)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Optional

from ..common.cli_range import MAX_SEED, count, number

# torch/megatron are imported inside the commands so that --help answers instantly.
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}


def _dtype(name: Optional[str]):
    if name is None:
        return None
    import torch

    try:
        return getattr(torch, DTYPES[name.lower()])
    except KeyError:
        raise SystemExit(f"unknown dtype {name!r}; use one of {sorted(DTYPES)}") from None


def _size(text: str) -> int:
    units = {"kb": 1024, "mb": 1024**2, "gb": 1024**3, "b": 1}
    t = text.strip().lower()
    for unit, mult in units.items():
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * mult)
    return int(t)


# the verify command's counts and tolerances (Range types: argparse refuses a value out of range
# naming the flag); the caps stop a typo's allocation: --batch 1e9 x --seq-len 1e9 logits
BATCH, SEQ_LEN, SEED = count(1, 4096), count(1, 1 << 20), count(0, MAX_SEED)
RTOL, ATOL = number(0.0, 100.0), number(0.0, 1e6)


def _bad_size(args: argparse.Namespace) -> Optional[str]:
    """Why ``--max-shard-size`` is not a size, or None (checked before any work)."""
    shard = getattr(args, "max_shard_size", None)
    if shard is not None:
        try:
            size = _size(shard)
        except (ValueError, OverflowError):
            size = None
        if size is None or not 1 <= size <= 1 << 50:
            return f"--max-shard-size must be a size like 4GB or 500MB (1 byte to 1 PiB), got {shard!r}"
    return None


def _rank0() -> bool:
    from ..common import comm  # torch loads after --help

    return comm.rank() == 0


_JSON_OUT: Optional[int] = None  # with --json: the real stdout's descriptor (fd 1 then points at stderr)


def _say(msg: str) -> None:
    if _rank0():
        print(msg, flush=True)


def _json_only_stdout() -> None:
    """With --json, stdout carries the JSON alone: everything else written to fd 1 (our lines,
    libraries' prints and progress bars, C code) goes to stderr; ``_emit_json`` writes the
    original stdout."""
    global _JSON_OUT
    sys.stdout.flush()
    _JSON_OUT = os.dup(1)
    os.dup2(2, 1)


def _finite_json(value):
    """``value`` with NaN / infinities as strings: strict JSON has no such numbers."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite_json(v) for v in value]
    return value


def _emit_json(result: dict) -> None:
    text = json.dumps(_finite_json(result), allow_nan=False) + "\n"
    if _JSON_OUT is None:
        print(text, end="", flush=True)
    else:
        sys.stdout.flush()
        os.write(_JSON_OUT, text.encode())


def _say_skipped_mtp(model) -> None:
    """DeepSeek-V3 / GLM-4.5 checkpoints carry multi-token-prediction layers the Megatron model
    does not build: say so, since a converted or exported checkpoint silently lacks them."""
    from .families import mtp_layers

    n = mtp_layers(model.hf_config)
    if n:
        _say(f"note: {n} multi-token-prediction layer(s) (num_nextn_predict_layers) not converted: the Megatron "
             "model has no MTP module and HF exports leave its weights out (docs/how-to/convert.md#model-families)")


def _layout(text: str):
    from .layout import ParallelLayout

    return ParallelLayout.from_string(text or "")


def _check_hf_sizes(hf_dir: str) -> None:
    """config.json's sizes against the safetensors headers, before anything is built from them."""
    from .hf_checkpoint import check_config_against_weights

    check_config_against_weights(hf_dir)


def cmd_hf_to_megatron(args: argparse.Namespace) -> int:
    from . import ModelOptions, build_model, save_megatron_checkpoint

    _check_hf_sizes(args.hf)
    t = time.time()
    model = build_model(args.hf, _layout(args.layout), ModelOptions(dtype=_dtype(args.dtype)))
    _say_skipped_mtp(model)
    save_megatron_checkpoint(model, args.out)
    _say(f"saved Megatron checkpoint {args.out} ({model.layout.describe()}, {model.dtype}) in {time.time() - t:.1f}s")
    return 0


def cmd_megatron_to_hf(args: argparse.Namespace) -> int:
    from . import ModelOptions, build_model, load_megatron_checkpoint, save_hf_checkpoint

    if bool(args.ckpt) == bool(args.hf):
        raise SystemExit("megatron-to-hf: give exactly one source, --ckpt (Megatron) or --hf (HF directory)")
    t = time.time()
    if args.ckpt:
        model = load_megatron_checkpoint(args.ckpt, _layout(args.layout))
    else:
        _check_hf_sizes(args.hf)
        model = build_model(args.hf, _layout(args.layout), ModelOptions())
    _say_skipped_mtp(model)
    save_hf_checkpoint(
        model, args.out, dtype=_dtype(args.dtype), fp8=args.fp8, max_shard_bytes=_size(args.max_shard_size)
    )
    kind = "FP8 (e4m3, 128x128 blocks)" if args.fp8 else str(_dtype(args.dtype) or model.dtype)
    _say(f"saved HF checkpoint {args.out} [{kind}] from {model.layout.describe()} in {time.time() - t:.1f}s")
    return 0


# Logits agree when max |diff| <= rtol * max |HF logit| + atol: float noise grows with the
# logits' scale (a trained model's logits reach ~10, a random tiny model's ~0.5), so the bound
# scales with them; atol covers logits near 0. Measured megatron vs transformers noise and the
# choice: docs/how-to/convert.md#verify.
DEFAULT_TOLERANCES = {"float32": (1e-4, 1e-6), "bfloat16": (0.25, 5e-2)}


def _tolerances(args: argparse.Namespace, dtype) -> tuple[float, float]:
    """(rtol, atol): --tolerance is an absolute bound alone (rtol 0), as before --rtol/--atol."""
    rtol, atol = DEFAULT_TOLERANCES[str(dtype).removeprefix("torch.")]
    if args.tolerance is not None:
        rtol, atol = 0.0, args.tolerance
    return (rtol if args.rtol is None else args.rtol), (atol if args.atol is None else args.atol)


def _compare_weights(model, hf_dir: str) -> Optional[dict]:
    """The model's weights exported under HF names against ``hf_dir``'s tensors, bit for bit (in
    the lower of the two dtypes: a bf16 source built in fp32 must come back exactly). Every rank
    runs the export (gathers inside); rank 0 compares and returns the summary."""
    import torch
    from safetensors import safe_open

    from . import iter_hf_weights
    from .hf_checkpoint import read_checkpoint, unused_allowed

    tensors = read_checkpoint(hf_dir)
    handles: dict = {}
    exported, equal, differ, shapes, extra, max_diff = set(), 0, [], [], [], 0.0
    for name, ours in iter_hf_weights(model):
        if not _rank0():
            continue
        exported.add(name)
        if name not in tensors:
            extra.append(name)
            continue
        entry = tensors[name]
        if entry.file not in handles:
            handles[entry.file] = safe_open(entry.file, framework="pt", device="cpu")
        theirs = handles[entry.file].get_tensor(name)
        ours = ours.cpu()
        common = ours.dtype if ours.element_size() <= theirs.element_size() else theirs.dtype
        a, b = ours.to(common), theirs.to(common)
        if a.shape == b.shape and torch.equal(a, b):
            equal += 1
            continue
        differ.append(name)
        if a.shape != b.shape:
            shapes.append(f"{name} {list(a.shape)} vs {list(b.shape)}")
        elif a.numel():
            max_diff = max(max_diff, (a.float() - b.float()).abs().max().item())
    if not _rank0():
        return None
    missing = sorted(n for n in tensors if n not in exported
                     and not unused_allowed(model.hf_config, n, exported, model.options.value_head))
    return {"compared": equal + len(differ), "equal": equal, "differ": sorted(differ)[:20], "num_differ": len(differ),
            "max_abs_diff": max_diff, "shape_differ": shapes[:20], "missing": missing[:20], "num_missing": len(missing),
            "extra": sorted(extra)[:20], "num_extra": len(extra),
            "ok": not differ and not missing and not extra}


def _weights_line(w: dict, hf_dir: str) -> str:
    if w["ok"]:
        return f"weights: all {w['equal']} tensors equal to {hf_dir}'s, bit for bit"
    parts = []
    if w["num_differ"]:
        shapes = f", shapes differ: {'; '.join(w['shape_differ'][:3])}" if w["shape_differ"] else ""
        parts.append(f"{w['num_differ']} of {w['compared']} tensors differ (max |diff| {w['max_abs_diff']:.3e}; "
                     f"first: {', '.join(w['differ'][:3])}{shapes})")
    if w["num_missing"]:
        parts.append(f"{w['num_missing']} of {hf_dir}'s tensors not exported (first: {', '.join(w['missing'][:3])})")
    if w["num_extra"]:
        parts.append(f"{w['num_extra']} exported tensors not in {hf_dir} (first: {', '.join(w['extra'][:3])})")
    return "weights: " + "; ".join(parts) + ": DIFFERENT"


def cmd_verify(args: argparse.Namespace) -> int:
    import torch

    from . import ModelOptions, build_model, forward_logits, load_megatron_checkpoint

    _check_hf_sizes(args.hf)  # transformers builds the reference from it in any case
    if args.ckpt:  # an LM's (a critic's is refused by the loader, naming it: no HF logits to compare with)
        model = load_megatron_checkpoint(args.ckpt, _layout(args.layout), ModelOptions(local_attention=args.attention))
    else:
        model = build_model(args.hf, _layout(args.layout),
                            ModelOptions(dtype=_dtype(args.dtype), local_attention=args.attention))
    _say_skipped_mtp(model)
    weights = _compare_weights(model, args.hf)
    gen = torch.Generator().manual_seed(args.seed)
    vocab = int(model.hf_config.vocab_size)
    tokens = torch.randint(0, vocab, (args.batch, args.seq_len), generator=gen)
    logits = forward_logits(model, tokens).float().cpu()
    result = {"layout": model.layout.describe(), "dtype": str(model.dtype), "tokens": list(tokens.shape)}
    ok = True
    if _rank0():
        from transformers import AutoModelForCausalLM

        from ..common.hf_build import HF_BUILD_LOCK

        with HF_BUILD_LOCK:
            hf = AutoModelForCausalLM.from_pretrained(args.hf, dtype=model.dtype)
        hf.eval()
        with torch.no_grad():
            ref = hf(tokens).logits.float()
        diff = (logits - ref).abs()
        rtol, atol = _tolerances(args, model.dtype)
        scale = ref.abs().max().item()
        bound = rtol * scale + atol
        logits_ok = bool(diff.max().item() <= bound)
        ok = logits_ok and weights["ok"]
        result.update(max_abs_diff=diff.max().item(), mean_abs_diff=diff.mean().item(), max_abs_logit=scale,
                      rtol=rtol, atol=atol, bound=bound, logits_ok=logits_ok, weights=weights, ok=ok)
        _say(_weights_line(weights, args.hf))
        _say(f"max |logit diff| = {result['max_abs_diff']:.3e} (mean {result['mean_abs_diff']:.3e}) vs bound "
             f"{bound:.3e} = rtol {rtol:g} x max |logit| {scale:.3g} + atol {atol:g} at {result['layout']}, "
             f"{result['dtype']}: {'OK' if logits_ok else 'MISMATCH'}")
        if args.json:
            _emit_json(result)
    from ..common import comm

    ok = bool(comm.broadcast(torch.tensor([1 if ok else 0]), src=0).item())  # rank 0 judged: every rank exits alike
    return 0 if ok else 1


def _output_overlap(args: argparse.Namespace) -> Optional[str]:
    """Why ``--out`` cannot be written, or None: it is, contains or lies inside an input
    (``--hf``, ``--ckpt``), compared as real paths (symlinks resolved). Writing there replaces
    or mixes with the files being read (``megatron-to-hf --hf X --out X --fp8`` replaced X's weights)."""
    out = getattr(args, "out", None)
    if not out:
        return None
    real_out = os.path.realpath(out)
    for flag in ("hf", "ckpt"):
        src = getattr(args, flag, None)
        if not src:
            continue
        real_src = os.path.realpath(src)
        common = os.path.commonpath([real_out, real_src])
        if real_out == real_src:
            relation = "is"
        elif common == real_src:
            relation = "is inside"
        elif common == real_out:
            relation = "contains"
        else:
            continue
        where = "" if (out, src) == (real_out, real_src) else f" ({real_out} and {real_src} once symlinks are resolved)"
        return f"--out {out} {relation} the input --{flag} {src}{where}: choose an output directory outside it"
    return None


def _unwritable_output(args: argparse.Namespace) -> Optional[str]:
    """Why ``--out`` cannot be written, found before any work (a conversion that ran for an hour
    must not fail at its last step): it is a file, or a directory cannot be made there or a file
    written in it (``/proc/x``). One process leaves nothing behind; under torchrun the directory
    stays (the conversion writes it anyway)."""
    out = getattr(args, "out", None)
    if not out:
        return None
    if os.path.lexists(out) and not os.path.isdir(out):
        return f"--out {out} exists and is not a directory"
    made: list[str] = []
    path = os.path.abspath(out)
    while not os.path.lexists(path):
        made.append(path)
        path = os.path.dirname(path)
    try:
        os.makedirs(out, exist_ok=True)
        import tempfile

        fd, probe = tempfile.mkstemp(dir=out, prefix=".write-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        return f"--out {out} cannot be written: {err.strerror or err}"
    finally:
        # under torchrun every rank probes at once: one removing the directory would fail another's probe
        for directory in made if int(os.environ.get("WORLD_SIZE", "1")) <= 1 else []:  # the deepest first
            try:
                os.rmdir(directory)
            except OSError:
                break
    return None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="convert.py",
        description="Convert between HuggingFace and Megatron checkpoints (any TP/PP/VPP/EP layout) "
        "and verify logits. Runs as one process or under torchrun (the layout must fit the world size).",
        epilog="Layouts are comma-separated key=value: tp, pp, vpp, ep, etp, sp, and first_stage_layers / "
        "last_stage_layers for uneven pipeline stages (e.g. 'tp=2,ep=2,etp=1', 'pp=4,first_stage_layers=16'). "
        "See docs/how-to/convert.md.",
    )
    p.add_argument("--verbose", action="store_true", help="keep library warnings")
    sub = p.add_subparsers(dest="command", required=True)

    a = sub.add_parser("hf-to-megatron", help="HF directory -> Megatron distributed checkpoint")
    a.add_argument("--hf", required=True, help="HF model directory (config.json + *.safetensors)")
    a.add_argument("--out", required=True, help="checkpoint directory to write")
    a.add_argument("--layout", default="", help="parallel layout, e.g. tp=2,pp=1 (default: all 1)")
    a.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: float32 on CPU, bfloat16 on GPU)")
    a.set_defaults(func=cmd_hf_to_megatron)

    b = sub.add_parser("megatron-to-hf", help="Megatron checkpoint (or HF dir) -> HF directory, optionally FP8")
    b.add_argument("--ckpt", help="Megatron checkpoint directory written by hf-to-megatron / training")
    b.add_argument("--hf", help="or: an HF directory (e.g. to write its FP8 version)")
    b.add_argument("--out", required=True, help="HF directory to write")
    b.add_argument("--layout", default="", help="layout to load at (any layout that fits the world size)")
    b.add_argument("--dtype", default=None, help="exported dtype for non-FP8 tensors: float32 or bfloat16")
    b.add_argument("--fp8", action="store_true", help="block-quantize linear weights to float8_e4m3fn (128x128)")
    b.add_argument("--max-shard-size", default="4GB", help="safetensors shard size (e.g. 4GB, 500MB)")
    b.set_defaults(func=cmd_megatron_to_hf)

    v = sub.add_parser("verify", help="compare transformers and Megatron logits on random tokens")
    v.add_argument("--hf", required=True, help="HF model directory (the reference, run by transformers)")
    v.add_argument("--ckpt", help="Megatron checkpoint to check instead of converting --hf on the fly")
    v.add_argument("--layout", default="", help="layout to run Megatron at")
    v.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: float32 on CPU)")
    v.add_argument("--batch", type=BATCH, default=2, help="random token sequences compared (default 2)")
    v.add_argument("--seq-len", type=SEQ_LEN, default=32, help="tokens per sequence (default 32)")
    v.add_argument("--seed", type=SEED, default=0, help="seed of the random tokens (default 0)")
    v.add_argument("--attention", choices=("sdpa", "unfused"), default="sdpa",
                   help="core attention without TransformerEngine: sdpa (torch's, default) or unfused (megatron's)")
    v.add_argument("--rtol", type=RTOL, default=None,
                   help="logits agree when max |diff| <= rtol x max |logit| + atol (default 1e-4 fp32, 0.25 bf16)")
    v.add_argument("--atol", type=ATOL, default=None, help="see --rtol (default 1e-6 fp32, 5e-2 bf16)")
    v.add_argument("--tolerance", type=ATOL, default=None,
                   help="an absolute bound on max |diff| instead (rtol 0, atol TOLERANCE)")
    v.add_argument("--json", action="store_true",
                   help="print the result as one JSON line: stdout carries only it, every other line goes to stderr")
    v.set_defaults(func=cmd_verify)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    overlap = _output_overlap(args) or _unwritable_output(args)
    if overlap:
        print(f"error: {overlap}", file=sys.stderr, flush=True)
        return 2
    bad = _bad_size(args)
    if bad:
        print(f"error: {bad}", file=sys.stderr, flush=True)
        return 2
    if getattr(args, "json", False):
        _json_only_stdout()
    if not args.verbose:
        # megatron/torch deprecation chatter would bury the one-line results.
        import warnings

        for category in (UserWarning, FutureWarning, DeprecationWarning):
            warnings.filterwarnings("ignore", category=category)
    import torch

    from .hf_config import CheckpointContentError, CheckpointFileError
    from .layout import LayoutError, UnsupportedModelError

    try:
        return args.func(args)
    except (LayoutError, UnsupportedModelError, CheckpointFileError, CheckpointContentError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        from .parallel import destroy_parallel

        if torch.distributed.is_initialized():
            destroy_parallel()


if __name__ == "__main__":
    sys.exit(main())
