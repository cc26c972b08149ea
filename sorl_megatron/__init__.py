"""sorl-megatron: Megatron-core RL for multi-turn MoE agents with off-policy stabilizers."""

import sys as _sys

__version__ = "0.1.0"

if _sys.argv[:1] == ["-m"]:
    # `python -m sorl_megatron.<module>` (train, study, the servers, ...): while Python locates the
    # module, argv[0] is "-m", and this package is imported first. Outside the project's environment
    # say so in one line before the module's own imports fail with a traceback.
    from .common.environment import require_environment

    _argv = getattr(_sys, "orig_argv", [])
    require_environment("python -m " + (_argv[_argv.index("-m") + 1] if "-m" in _argv[:-1] else __name__))
