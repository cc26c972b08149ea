"""Losses with a surrogate of their own, one file each: the surrogate and its
``register_policy_loss`` call. The package ``sorl_megatron.algorithms`` imports this one, so
a loss here is registered before any module of the package is used (importing
``sorl_megatron.algorithms.loss_registry`` runs the package's ``__init__`` first); a new file
is added to the imports below."""

from . import cispo  # noqa: F401
