"""The profiler's own lines on the process's stderr, kept off the console.

torch's profiler (Kineto) writes ``USDT:… SyncActivityProfilerHandler.cpp:52] profiler_start`` / ``profiler_stop`` at
every start and stop, and once ``Memory block of unknown size was allocated before the profiling started``, from C++
straight to file descriptor 2: neither ``KINETO_LOG_LEVEL`` nor ``TORCH_CPP_LOG_LEVEL`` silences them (torch 2.13).
Around the calls that start and stop it, :func:`filtered_stderr` points descriptor 2 at a temporary file, then writes
back every line that is not one of those — nothing else is lost, only delayed to the end of the call.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

NOISE = re.compile(r"^USDT:.*SyncActivityProfilerHandler\.cpp:\d+\] profiler_(start|stop)\s*$"
                   r"|Memory block of unknown size was allocated before the profiling started")


@contextmanager
def filtered_stderr() -> Iterator[None]:
    """Descriptor 2 captured while the block runs; its lines written back to stderr, the profiler's own
    (:data:`NOISE`) left out. Where descriptor 2 cannot be duplicated (no such descriptor), the block runs as is."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = [line for line in tmp.read().decode("utf-8", "replace").splitlines(keepends=True)
                    if not NOISE.search(line)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()
