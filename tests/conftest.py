"""Shared fixtures: small data the tests write themselves (a WNDB directory, JSONL/CSV files)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from train.config import load_config

HEADER = "  1 This software and database is being provided to you, the LICENSEE, by  \n"

# Words that make each class learnable from the gloss alone.
CLASS_WORDS = {
    ("noun", "n", 5): ["animal", "mammal", "bird", "fur", "tail", "species"],  # noun.animal
    ("noun", "n", 6): ["tool", "device", "machine", "metal", "handle", "built"],  # noun.artifact
    ("verb", "v", 38): ["move", "walk", "run", "travel", "go", "fast"],  # verb.motion
    ("adj", "a", 0): ["good", "bad", "large", "small", "quality", "having"],  # adj.all
}


def write_wndb(root: Path, rows: list[tuple[str, str, int, list[str], str]]) -> Path:
    """Write data.noun/verb/adj/adv with real byte offsets. rows: (file, ss_type, lex_filenum, words, gloss)."""
    root.mkdir(parents=True, exist_ok=True)
    by_file: dict[str, list] = {"noun": [], "verb": [], "adj": [], "adv": []}
    for row in rows:
        by_file[row[0]].append(row)
    for pos_file, items in by_file.items():
        out = HEADER
        for _, ss_type, lex, words, gloss in items:
            offset = len(out.encode())
            word_part = " ".join(f"{w} 0" for w in words)
            out += f"{offset:08d} {lex:02d} {ss_type} {len(words):02x} {word_part} 000 | {gloss}  \n"
        (root / f"data.{pos_file}").write_text(out, encoding="utf-8")
    return root


def synthetic_rows(n_per_class: int = 60, seed: int = 0) -> list[tuple[str, str, int, list[str], str]]:
    rng = random.Random(seed)
    filler = ["the", "of", "a", "that", "which", "or", "in", "to", "is", "for"]
    rows = []
    for (pos_file, ss_type, lex), words in CLASS_WORDS.items():
        for i in range(n_per_class):
            n = rng.randint(3, 14)
            gloss = " ".join(rng.choice(words if rng.random() < 0.5 else filler) for _ in range(n))
            rows.append((pos_file, ss_type, lex, [f"{words[i % len(words)]}_{i}"], gloss))
    rows.append(("adv", "r", 2, ["quickly"], "with speed"))
    return rows


@pytest.fixture(autouse=True)
def _no_wandb_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs in tests log JSONL only (W&B init costs seconds); W&B tests delete this variable."""
    monkeypatch.setenv("WANDB_MODE", "disabled")


@pytest.fixture(autouse=True)
def _cpu_without_native_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test sees a CPU without native bf16 unless it asks for :func:`precision_branch`: ``precision=auto``
    then picks fp32 by rule on every machine (AVX2-only or AVX512-BF16), never a measured, machine-dependent
    choice. (Subprocesses do not inherit this; their tests compare runs on the same machine.)"""
    monkeypatch.setattr("train.precision.cpu_native_bf16", lambda: False)


@pytest.fixture(params=["cpu-without-native-bf16", "cpu-with-native-bf16"])
def precision_branch(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> dict:
    """Both branches of ``precision=auto`` on a CPU, on any machine: the decision's inputs (native bf16 or not,
    the probe's fp32/bf16 timing: bf16 3x faster, and a quiet machine) are forced. Returns what ``auto`` must then decide."""
    native = request.param == "cpu-with-native-bf16"
    calls: list = []

    def measured(probe, repeats=9):
        calls.append(probe)
        return {"fp32_ms": 3.0, "bf16_ms": 1.0, "ratio": 3.0, "repeats": repeats}

    monkeypatch.setattr("train.precision.cpu_native_bf16", lambda: native)
    monkeypatch.setattr("train.precision.measure_bf16_speedup", measured)
    monkeypatch.setattr("train.precision.machine_load", lambda: 0.0)  # a quiet machine: the decision is cached
    return {"native": native, "mode": "bf16" if native else "fp32", "source": "measured" if native else "rule",
            "probe_calls": calls}


@pytest.fixture
def wndb(tmp_path: Path) -> Path:
    return write_wndb(tmp_path / "wn", synthetic_rows())


@pytest.fixture
def tiny_cfg(wndb: Path, tmp_path: Path):
    """A config that trains the smallest model for a few steps on the fixture WordNet."""

    def make(*overrides: str):
        base = [f"data.wordnet_dir={wndb}", f"data.cache_dir={tmp_path / 'cache'}", "data.vocab_size=200",
                "data.max_len=32", "model.num_layers=1", "model.hidden_size=32", "model.num_heads=2",
                "model.ffn_size=64", "model.dropout=0.0", "batching.num_buckets=3", "batching.batch_size=16",
                "train.max_steps=30", "train.eval_every=15", "train.log_every=5", "train.progress=false",
                f"train.output_dir={tmp_path / 'runs'}", "train.run_id=t", "optim.lr=5e-3"]
        return load_config(None, base + list(overrides))

    return make


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records), encoding="utf-8")
    return path
