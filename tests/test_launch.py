"""``train/tools/launch.py`` (``make … NPROC=N``'s torchrun): a rank's bad input keeps exit 2 and its one line, a
rank torchrun stopped after it does not change that, any other failure is torchrun's own error, and a signal to the
launcher is one line and exit 0. torchrun's ``run`` is replaced: what is tested is the mapping of its outcomes."""

from __future__ import annotations

import time

import pytest
import torch.distributed.run
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from train.tools import launch


def failing(*exits: int):
    failures = {}
    for rank, code in enumerate(exits):
        failures[rank] = ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code, error_file="")
        failures[rank].timestamp = int(time.time()) + rank  # rank 0 failed first

    def run(_args) -> None:
        raise ChildFailedError("train", failures)

    return run


ARGS = ["--standalone", "--nproc_per_node=2", "-m", "train", "train"]


@pytest.mark.parametrize("exits, code", [((2, 2), 2), ((2, -15), 2), ((3, -15), 3)])
def test_a_rank_s_bad_input_or_numerics_abort_is_the_job_s_exit_code(monkeypatch, capsys, exits, code) -> None:
    monkeypatch.setattr(torch.distributed.run, "run", failing(*exits))
    assert launch.main(ARGS) == code
    assert capsys.readouterr().err == ""  # the rank printed its line; the launcher adds nothing


@pytest.mark.parametrize("exits", [(1, -15), (-9, 2), (2, 1)])
def test_any_other_failure_is_torchrun_s_own_error(monkeypatch, exits) -> None:
    monkeypatch.setattr(torch.distributed.run, "run", failing(*exits))
    with pytest.raises(ChildFailedError):
        launch.main(ARGS)


def test_a_signal_to_the_launcher_is_one_line_and_exit_0(monkeypatch, capsys) -> None:
    import signal

    def run(_args) -> None:
        raise SignalException("got signal: 15", signal.SIGTERM)

    monkeypatch.setattr(torch.distributed.run, "run", run)
    assert launch.main(ARGS) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "SIGTERM passed to every rank" in err
