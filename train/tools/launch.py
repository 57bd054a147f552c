"""``make … NPROC=N``'s launcher: torchrun (``torch.distributed.run``, its arguments) with the product's exit codes.

torchrun itself turns any worker's non-zero exit into a ``ChildFailedError`` traceback and exit 1, and a signal to it
into a ``SignalException`` traceback: a bad input (each rank already printed its one ``error:`` line, exit 2) or a
numerics abort (exit 3) would end in twenty lines of launcher internals. Here, when every failed rank exited 2 or 3,
that code is the job's, with nothing more printed; a SIGTERM/SIGINT to the launcher is one line and exit 0 — torchrun
has passed the signal to the ranks, which finish their step, checkpoint and report ``interrupted`` (torchrun waits
30 s for them before it kills them; a checkpoint cut short leaves the previous one). Anything else is torchrun's own
error, unchanged.

    python -m train.tools.launch --standalone --nproc_per_node=2 -m train train --config …
"""

from __future__ import annotations

import logging
import signal
import sys
from typing import Optional

QUIET_EXITS = (2, 3)  # a rank's UserError (bad input) or NumericsAbort: it printed its own line
STOPPED = (-signal.SIGTERM, -signal.SIGKILL)  # a rank torchrun stopped after another one failed


def main(argv: Optional[list[str]] = None) -> int:
    """Run torchrun with ``argv`` (default: this process's arguments); returns the job's exit code."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # its "failed (exitcode: 2)" line would follow the rank's own; another failure still raises its full report
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    try:
        run(parse_args(sys.argv[1:] if argv is None else argv))
    except ChildFailedError as exc:
        codes = [f.exitcode for f in exc.failures.values()]
        first = min(exc.failures.values(), key=lambda f: f.timestamp).exitcode  # the others: stopped by torchrun
        if first in QUIET_EXITS and all(c in QUIET_EXITS or c in STOPPED for c in codes):
            return first
        raise
    except SignalException as exc:
        print(f"launch: {exc.sigval.name} passed to every rank: each finishes its step, checkpoints and stops "
              "(report.json: interrupted)", file=sys.stderr, flush=True)
        return 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
