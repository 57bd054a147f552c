"""Checkpoint files: never seen half-written by a concurrent reader; RNG states survive ``weights_only=True``."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from train.checkpoint import load_checkpoint, rng_state, save_checkpoint, set_rng_state
from train.errors import UserError

ROOT = Path(__file__).resolve().parent.parent

READER = """
import json, sys, time
from train.checkpoint import load_checkpoint
from train.errors import UserError
path, seconds = sys.argv[1], float(sys.argv[2])
ok = bad = 0
sizes = set()
t_end = time.monotonic() + seconds
while time.monotonic() < t_end:
    try:
        state = load_checkpoint(path)
        assert state["w"].numel() == state["n"] and bool((state["w"] == state["n"]).all())
        ok += 1
        sizes.add(state["n"])
    except UserError as exc:
        bad += 1
        print(exc, file=sys.stderr)
print(json.dumps({"ok": ok, "bad": bad, "versions": len(sizes)}))
"""


def test_a_reader_never_sees_a_half_written_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, {"w": torch.full((1000,), 1000.0), "n": 1000})
    reader = subprocess.Popen([sys.executable, "-c", READER, str(path), "4"], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    writes = 0
    while reader.poll() is None:  # rewrite it as fast as possible, with changing sizes, while the reader loads it
        n = random.choice([1000, 200_000, 1_000_000])
        save_checkpoint(path, {"w": torch.full((n,), float(n)), "n": n})
        writes += 1
    out, err = reader.communicate()
    result = json.loads(out)
    assert result["bad"] == 0, err
    assert result["ok"] > 0 and writes > 5
    assert not list(tmp_path.glob("*.tmp"))


def test_rng_states_roundtrip_through_a_weights_only_checkpoint(tmp_path: Path) -> None:
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.gauss(0, 1), np.random.standard_normal()  # leave cached Gaussians in the states
    save_checkpoint(tmp_path / "r.pt", {"rng": rng_state()})
    expected = (random.random(), random.gauss(0, 1), np.random.standard_normal(3).tolist(), torch.rand(3))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    set_rng_state(load_checkpoint(tmp_path / "r.pt")["rng"])  # weights_only=True
    got = (random.random(), random.gauss(0, 1), np.random.standard_normal(3).tolist(), torch.rand(3))
    assert got[:3] == expected[:3] and torch.equal(got[3], expected[3])


class NotAllowed:
    pass


def test_a_checkpoint_with_a_pickled_object_is_refused(tmp_path: Path) -> None:
    torch.save({"model": {"w": torch.zeros(2)}, "extra": NotAllowed()}, tmp_path / "x.pt")
    with pytest.raises(UserError, match="holds objects other than tensors and plain values; refusing to unpickle"):
        load_checkpoint(tmp_path / "x.pt")


def test_save_failure_keeps_the_previous_file(tmp_path: Path, monkeypatch) -> None:
    import errno

    save_checkpoint(tmp_path / "c.pt", {"step": 1})

    def full(obj, f, *a, **k):
        Path(f).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(UserError, match="the disk is full"):
        save_checkpoint(tmp_path / "c.pt", {"step": 2})
    monkeypatch.undo()
    assert load_checkpoint(tmp_path / "c.pt") == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]
