"""Triton kernels for segment reductions and memory-lean log-probs.

Installed as the import package ``sorl_kernels`` (the folder is ``kernels/``), so it cannot
clash with the PyPI package named ``kernels``.
"""
