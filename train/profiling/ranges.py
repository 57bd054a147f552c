"""Named ranges around the stages of a training step (data wait, forward, loss, backward, optimizer).

The trainer always calls ``self.ranges("forward")`` etc.; by default that returns one shared
``contextlib.nullcontext`` (no allocation, no profiler call). A profile swaps in
:class:`ProfilerRanges`, which opens a ``torch.profiler.record_function`` range (visible in the
torch.profiler trace) and, on CUDA, an NVTX range (visible in Nsight Systems).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager as ContextManager

import torch

STAGES = ("data_wait", "forward", "loss", "backward", "optimizer")
"""Stage names the trainer uses; the trace/NVTX range of stage ``s`` is named ``RANGE_PREFIX + s``. ``loss``: the
task's loss on the forward's output — with a causal LM's chunked loss, the LM head's forward and its gradient too
(they run there, chunk by chunk); otherwise the head is in ``forward`` and ``backward``."""
RANGE_PREFIX = "train/"

_NULL = contextlib.nullcontext()


def null_ranges(name: str) -> ContextManager:
    """The default: a shared no-op context, whatever ``name`` is."""
    return _NULL


class ProfilerRanges:
    """``ranges(name)`` → a ``record_function`` range named ``train/<name>``, plus NVTX on CUDA.

    Source: torch.profiler.record_function and torch.cuda.nvtx.range (PyTorch docs).
    """

    def __init__(self, nvtx: bool = False) -> None:
        self.nvtx = nvtx and torch.cuda.is_available()

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        label = RANGE_PREFIX + name
        with torch.profiler.record_function(label):
            if self.nvtx:
                with torch.cuda.nvtx.range(label):
                    yield
            else:
                yield
