"""The stability study: the grid runner and the indicator analysis."""
