"""Rollout sources: one class per rollout mode (``rollout.mode``) and the pending batches they keep."""
