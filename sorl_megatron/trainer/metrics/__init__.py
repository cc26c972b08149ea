"""What a run records: the metrics log, the plots, the mismatch indicators."""
