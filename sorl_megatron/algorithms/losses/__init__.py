"""Losses with a surrogate of their own, one file each: the surrogate and its
``register_policy_loss`` call. ``loss_registry`` imports this package, so a loss here is
registered whenever the registry is; a new file is added to the imports below."""

from . import cispo  # noqa: F401
