"""An SGLang launch line checked, before any server starts, against the checks the trainer makes
of a running server (:mod:`.server_facts`): the line is turned into the ``/server_info`` fields
those checks read, and the same functions judge it. What a launch line can get wrong for RL:

- ``--quantization fp8`` on a BF16 checkpoint (online per-tensor FP8, a layout no sync can write):
  FP8 rollouts serve an FP8-serialized export instead (``tools/convert.py megatron-to-hf --fp8``);
- ``rollout.precision: fp8`` with a BF16 checkpoint served, or the reverse;
- ``--skip-tokenizer-init`` (every agent turn sends stop strings, which such a server refuses);
- R3 routing replay without ``--enable-return-routed-experts``.

Only the flags these checks read are parsed (their SGLang 0.5.21 names and aliases; the suite
checks them, and every launch line the project documents, against SGLang's released argument
definitions); other flags are left to SGLang.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from .server_facts import SESSIONS_SINCE, ServerFacts, ServerMismatchError, served_weight_format

# flag -> (the /server_info field, whether it takes a value)
FLAGS: dict[str, tuple[str, bool]] = {
    "--model-path": ("model_path", True), "--model": ("model_path", True),
    "--quantization": ("quantization", True),
    "--tp-size": ("tp_size", True), "--tensor-parallel-size": ("tp_size", True),
    "--skip-tokenizer-init": ("skip_tokenizer_init", False),
    "--enable-return-routed-experts": ("enable_return_routed_experts", False),
    "--nnodes": ("nnodes", True), "--node-rank": ("node_rank", True), "--dist-init-addr": ("dist_init_addr", True),
}


def server_info_of(argv: Sequence[str]) -> dict[str, Any]:
    """The ``/server_info`` fields a server started with ``argv`` reports, for the flags above
    (``--flag value`` and ``--flag=value``; argparse's unique prefixes, e.g. ``--tp``)."""
    info: dict[str, Any] = {"version": ".".join(map(str, SESSIONS_SINCE))}
    words = list(argv)
    i = 0
    while i < len(words):
        flag, _, inline = words[i].partition("=")
        name = _resolve(flag)
        i += 1
        if name is None:
            continue
        field, takes_value = FLAGS[name]
        if not takes_value:
            info[field] = True
        elif inline or "=" in words[i - 1]:
            info[field] = inline
        elif i < len(words):
            info[field] = words[i]
            i += 1
    return info


def _resolve(flag: str) -> Optional[str]:
    if not flag.startswith("--"):
        return None
    if flag in FLAGS:
        return flag
    if flag == "--tp":  # argparse's unique prefix of --tp-size in SGLang 0.5.21 (tested against its flags)
        return "--tp-size"
    return None


def launch_line_problem(argv: Sequence[str], precision: str, routes: bool,
                        checkpoint_config: Optional[dict] = None) -> Optional[str]:
    """Why the trainer would refuse a server started with ``argv`` (None: it would not).
    ``precision``: the recipe's ``rollout.precision``; ``routes``: R3 replay is on;
    ``checkpoint_config``: the served checkpoint's ``quantization_config`` (None: a BF16 one)."""
    info = server_info_of(argv)
    try:
        facts = ServerFacts.from_server_info("<launch line>", info)
        facts.check_rollouts()
        served_weight_format(facts, "fp8" if precision == "fp8" else "bf16",
                             checkpoint_config={} if checkpoint_config is None else checkpoint_config)
    except ServerMismatchError as err:
        return str(err)
    if routes and not info.get("enable_return_routed_experts"):
        return ("algorithm.routing_replay is r3, which replays the routes each server returns: start the servers "
                "with --enable-return-routed-experts")
    return None
