"""Sharding a model over the ranks of a torchrun job (``dist.strategy``); the process group itself is
train/parallel/process_group.py's."""
