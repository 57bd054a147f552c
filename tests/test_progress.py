"""train/tools/progress.py: one rule for every progress bar — drawn on a terminal when train.progress is true, else
silent."""

import sys

import pytest

from train.tools.progress import beside, progress_bar


def test_bar_is_silent_when_stderr_is_not_a_tty(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    with progress_bar(3, "x", True) as bar:
        assert bar.disable
        bar.update(3)  # a no-op, no error


def test_bar_is_drawn_on_a_tty_only_when_enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    with progress_bar(3, "x", True, unit="shape") as bar:
        assert not bar.disable and bar.total == 3 and bar.unit == "shape"
        bar.update(1)
        assert bar.n == 1
    with progress_bar(3, "x", False) as bar:  # train.progress=false
        assert bar.disable


def test_notices_beside_a_bar_still_reach_their_sink(monkeypatch: pytest.MonkeyPatch) -> None:
    said: list[str] = []
    for tty in (False, True):
        monkeypatch.setattr(sys.stderr, "isatty", lambda tty=tty: tty)
        with progress_bar(2, "x", True) as bar:
            beside(bar, said.append)(f"tty={tty}")
    assert said == ["tty=False", "tty=True"]
