"""Checkpoint -> engine -> rendered Triton model repository.

Run as ``python -m build_engine``. With no ``--model`` a demo checkpoint is generated locally, because this
project must serve something on a machine that cannot download models.
"""
