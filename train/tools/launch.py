"""``make … NPROC=N``'s launcher: torchrun (``torch.distributed.run``, its arguments) with the product's exit codes.

torchrun itself turns any worker's non-zero exit into a ``ChildFailedError`` traceback and exit 1, and a signal to it
into a ``SignalException`` traceback. Here the job's exit code says what happened, for a scheduler to act on:

* 0: every rank finished.
* 2 / 3: the first rank to fail had bad input or a numerics abort (it printed its own ``error:`` line; the ranks
  torchrun stopped after it change nothing); nothing more is printed.
* 143 / 130: a SIGTERM / SIGINT, to the launcher (torchrun passes it to the ranks, which finish their step,
  checkpoint and report ``interrupted``; torchrun waits 30 s for them before it kills them, and a checkpoint cut short
  leaves the previous one) or to the ranks themselves (each exits 128 + the signal after its checkpoint). One line.
* 128 + N: the first rank to fail was killed by signal N — 137 for SIGKILL, which is what the kernel's OOM killer
  sends. One line names the rank and its pid.
* Anything else (a rank's exception: 1): torchrun's own error, unchanged.

    python -m train.tools.launch --standalone --nproc_per_node=2 -m train train --config …
"""

from __future__ import annotations

import logging
import signal
import sys
from typing import Optional

QUIET_EXITS = (2, 3)  # a rank's UserError (bad input) or NumericsAbort: it printed its own line
SIGNALLED = (128 + signal.SIGTERM, 128 + signal.SIGINT)  # ranks that checkpointed after a signal to them
STOPPED = (-signal.SIGTERM, -signal.SIGKILL)  # a rank torchrun stopped after another one failed


def main(argv: Optional[list[str]] = None) -> int:
    """Run torchrun with ``argv`` (default: this process's arguments); returns the job's exit code (module doc)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # its "failed (exitcode: 2)" line would follow the rank's own; another failure still raises its full report
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    try:
        run(parse_args(sys.argv[1:] if argv is None else argv))
    except ChildFailedError as exc:
        codes = [f.exitcode for f in exc.failures.values()]
        rank, first = min(exc.failures.items(), key=lambda kv: kv[1].timestamp)  # the others: stopped by torchrun
        if first.exitcode in QUIET_EXITS + SIGNALLED and all(c in QUIET_EXITS + SIGNALLED + STOPPED for c in codes):
            if first.exitcode in SIGNALLED:
                print(f"launch: the ranks stopped on {signal.Signals(first.exitcode - 128).name} after their "
                      "checkpoint (report.json: interrupted)", file=sys.stderr, flush=True)
            return first.exitcode
        if first.exitcode < 0:  # killed by a signal, nothing of its own printed
            try:
                name = signal.Signals(-first.exitcode).name
            except ValueError:  # a real-time signal has no name in the enum
                name = f"signal {-first.exitcode}"
            oom = " (the kernel's OOM killer sends it when memory runs out: dmesg says)" if name == "SIGKILL" else ""
            print(f"launch: rank {rank} (pid {first.pid}) was killed by {name}{oom}; torchrun stopped the others",
                  file=sys.stderr, flush=True)
            return 128 - first.exitcode
        raise
    except SignalException as exc:
        print(f"launch: {exc.sigval.name} passed to every rank: each finishes its step, checkpoints and stops "
              "(report.json: interrupted)", file=sys.stderr, flush=True)
        return 128 + exc.sigval.value
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
