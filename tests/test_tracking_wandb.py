"""One real W&B run, offline (wandb runs without a network): the files exist and hold the expected history keys."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest

from train.run.training import run_training

pb = pytest.importorskip("wandb.proto.wandb_internal_pb2")


def wandb_history(path: Path) -> list[dict]:
    """History rows of a ``run-*.wandb`` file: W&B's 7-byte header (":W&B", magic, version), then LevelDB
    log records (32 KiB blocks; each chunk: crc32, length u16, type u8 — 1 full, 2 first, 3 middle, 4 last)
    holding ``wandb_internal_pb2.Record`` protobufs. (wandb 0.31 no longer ships a Python reader.)"""
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, block, buf, rows = 7, 32768, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            if rec.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
    return rows


def test_offline_wandb_run_writes_history(tiny_cfg, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    cfg = tiny_cfg("train.max_steps=20", "train.log_every=5", "train.eval_every=10", "tracking.wandb=on",
                   "tracking.grad_stats_every=2", "tracking.system_interval_s=0.2", "tracking.init_timeout_s=180",
                   "tracking.finish_timeout_s=120")
    report = run_training(cfg, time.perf_counter())
    t = report["tracking"]
    assert t["wandb_active"] is True, t["wandb_fallback_reason"]
    assert t["wandb_mode"] == "offline" and t["dropped_records"] == 0
    run_dir = Path(t["wandb_dir"])
    assert run_dir.parent == Path(report["run_dir"]) / "wandb" and run_dir.name.startswith("offline-run-")
    assert t["wandb_sync_command"] == f"wandb sync {run_dir}"
    (store,) = run_dir.glob("run-*.wandb")
    rows = wandb_history(store)
    keys = set().union(*rows)
    assert {"step", "train/loss", "train/lr", "train/step_time_ms", "train/token_efficiency", "train/grad_norm",
            "eval/accuracy", "grad_norm/head.weight", "grad_std/head.weight",
            "system/process_rss_bytes"} <= keys, sorted(keys)
    assert [r["step"] for r in rows if "train/loss" in r] == [5, 10, 15, 20]
    jsonl = [json.loads(x) for x in (Path(report["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in jsonl if "loss" in r)
    assert next(r for r in rows if "train/loss" in r)["train/loss"] == pytest.approx(first["loss"])
    assert t["wandb_logged_records"] == len(jsonl)  # every JSONL record reached W&B
