"""``python -m sorl_megatron.study``: the grid runner's command line (study/runner.py)."""

from .runner import main

raise SystemExit(main())
