"""``train/tools/launch.py`` (``make … NPROC=N``'s torchrun): a rank's bad input keeps exit 2 and its one line, a
rank torchrun stopped after it does not change that, ranks that checkpointed after a signal give 128 + the signal, a
rank killed by a signal (the OOM killer's SIGKILL) gives 128 + it with one line naming the rank, any other failure is
torchrun's own error, and a signal to the launcher is one line and 128 + the signal. torchrun's ``run`` is replaced:
what is tested is the mapping of its outcomes."""

from __future__ import annotations

import signal
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


@pytest.mark.parametrize("exits, code", [((143, 143), 143), ((130, -15), 130), ((143, -9), 143)])
def test_ranks_that_checkpointed_after_a_signal_give_128_plus_it(monkeypatch, capsys, exits, code) -> None:
    monkeypatch.setattr(torch.distributed.run, "run", failing(*exits))
    assert launch.main(ARGS) == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "after their checkpoint" in err


@pytest.mark.parametrize("exits, code, name", [((-9, -15), 137, "SIGKILL"), ((-9, 2), 137, "SIGKILL"),
                                               ((-11, -15), 139, "SIGSEGV")])
def test_a_rank_killed_by_a_signal_gives_128_plus_it_and_one_line(monkeypatch, capsys, exits, code, name) -> None:
    monkeypatch.setattr(torch.distributed.run, "run", failing(*exits))
    assert launch.main(ARGS) == code  # before: torchrun's ChildFailedError, exit 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"rank 0 (pid 100) was killed by {name}" in err
    assert ("OOM killer" in err) == (name == "SIGKILL")


@pytest.mark.parametrize("exits", [(1, -15), (2, 1), (143, 1)])
def test_any_other_failure_is_torchrun_s_own_error(monkeypatch, exits) -> None:
    monkeypatch.setattr(torch.distributed.run, "run", failing(*exits))
    with pytest.raises(ChildFailedError):
        launch.main(ARGS)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_launcher_is_one_line_and_128_plus_it(monkeypatch, capsys, signum) -> None:
    def run(_args) -> None:
        raise SignalException(f"got signal: {signum}", signum)

    monkeypatch.setattr(torch.distributed.run, "run", run)
    assert launch.main(ARGS) == 128 + signum  # 143 for SIGTERM: a scheduler restarts it (OnFailure)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{signum.name} passed to every rank" in err
