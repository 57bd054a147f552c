"""Real torch.compile (inductor, C++ via gcc) on the smallest model: warm-up, restore, recompile accounting.

The fast tests share one compile cache directory (session-scoped), so graphs compiled by one test are
cache hits for the next. Tests marked slow run several processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from train.compiling.warmup import start_compile, warm_up_for_run
from train.data import make_loader, prepare_data
from train.precision import PrecisionPolicy
from train.run.training import run_training
from train.setup import build_model, seed_everything
from train.trainer import Trainer

# One bucket and a batch larger than the training split: one training shape, which evaluation (validation and
# test, their batches filled up to it) runs too: two graphs (training; evaluation: no grad).
FEW_SHAPES = ["batching.num_buckets=1", "batching.batch_size=512", "compile.enabled=true", "compile.warmup_window=3",
              "compile.warmup_max_steps=6", "compile.warmup_cv=0.5"]


@pytest.fixture(scope="session")
def shared_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("inductor-cache")


@pytest.fixture
def compile_env(shared_cache: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(shared_cache))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(shared_cache / "triton"))
    torch._dynamo.reset()
    yield shared_cache
    torch._dynamo.reset()


def test_new_shape_after_warmup_is_a_recompile_and_warmup_restores_bit_exactly(tiny_cfg, compile_env: Path) -> None:
    # the fast suite's real compile: one training shape (forward + backward graph); evaluation shapes are
    # left out of the warm-up here so the deliberate new shape below is an evaluation batch (a forward-only graph)
    cfg = tiny_cfg(*FEW_SHAPES, f"compile.cache_dir={compile_env}", "compile.warmup_eval=false")
    device = torch.device("cpu")
    seed_everything(0)
    bundle = prepare_data(cfg, None, notice=lambda _m: None)
    model = build_model(cfg, bundle)
    loaders = [make_loader(bundle, s, cfg, train=s == "train", device=device) for s in ("train", "validation", "test")]
    session = start_compile(cfg, device, model, bundle.pad_to, loaders[0], loaders[1:])
    assert session.enabled and session.cache.dir == str(compile_env.resolve())
    policy = PrecisionPolicy.create("fp32", device)
    trainer = Trainer(cfg=cfg, model=model, policy=policy, device=device, train_loader=loaders[0],
                      eval_loader=loaders[1], num_classes=bundle.num_classes, train_model=session.forward)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()

    result = warm_up_for_run(session, trainer, model, None, notice=lambda _m: None)

    # the training state is exactly what it was: weights, optimizer, scheduler, RNG
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not trainer.optimizer.state and trainer.scheduler.last_epoch == 0
    assert torch.equal(torch.get_rng_state(), rng) and result["restored_bit_exact"]
    assert [r["phase"] for r in result["shapes"]] == ["train"], result["shapes"]
    assert all(r["graphs_compiled"] >= 1 for r in result["shapes"])  # each shape compiled its own graph
    assert all(r["graphs_compiled_after_first_step"] == 0 for r in result["shapes"])
    assert all(r["steps"] >= 3 and r["cv"] is not None for r in result["shapes"])

    # the warmed shape: no recompile
    (key, shape), = session.shapes.items()
    batch = shape.batches[0]
    ids, mask = batch["input_ids"], batch["attention_mask"]
    for _ in range(2):
        trainer.step(batch, count=False)
    assert session.monitor.graphs_after_warmup == 0 and not session.monitor.events

    # a deliberate new shape after warm-up: 5 samples, evaluation mode
    model.eval()
    with torch.no_grad():
        session.forward(ids[:5], mask[:5], policy.blocks_autocast)
    model.train()
    m = session.monitor
    assert m.graphs_after_warmup >= 1 and len(m.events) == 1
    event = m.events[0]
    assert event["shape"] == [5, ids.shape[1]] and event["phase"] == "eval"
    assert "new eval shape" in event["reason"] and "not among the 1 warmed shapes" in event["reason"]
    assert event["guard_failures"], event  # dynamo's own words (grad mode / size mismatch)
    report = session.report()
    assert report["recompiles_after_warmup"] == m.graphs_after_warmup and report["status"] == "recompiled after warm-up"
    assert any("recompile(s) after warm-up" in line for line in session.loud_warnings())
    session.monitor.close()



def test_blocks_context_argument_compiles_once_without_graph_break(compile_env: Path) -> None:
    # the trainer passes ``policy.blocks_autocast`` (a bound method of a plain object) into the compiled
    # forward; torch < 2.4 graph-broke on calling it and recompiled on every call (compat.traceable_callable)
    from train.compiling.session import CompiledForward, RecompileMonitor
    from train.config import CompileConfig
    from train.models.encoder import EncoderClassifier

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.lin = torch.nn.Embedding(10, 8), torch.nn.Linear(8, 3)

        forward = EncoderClassifier.forward  # the real model's forward: with blocks_context(): encode

        def encode(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            return torch.relu(x) * attention_mask[..., None]

        def pool_and_classify(self, h: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            return self.lin(h.mean(1))

    monitor = RecompileMonitor()
    fwd = CompiledForward(Tiny(), CompileConfig(enabled="true", backend="eager"), monitor)
    policy = PrecisionPolicy.create("fp32", torch.device("cpu"))
    ids, mask = torch.randint(0, 10, (4, 6)), torch.ones(4, 6, dtype=torch.bool)
    fwd(ids, mask, policy.blocks_autocast)
    assert monitor.graphs_warmup == 1  # one graph: no graph break at the blocks context
    monitor.end_warmup()
    for _ in range(3):
        fwd(ids, mask, policy.blocks_autocast)
    assert monitor.graphs_after_warmup == 0 and not monitor.events
    monitor.close()

@pytest.mark.slow
def test_compiled_training_run_reports_zero_recompiles(tiny_cfg, compile_env: Path) -> None:
    cfg = tiny_cfg(*FEW_SHAPES, f"compile.cache_dir={compile_env}", "train.max_steps=12", "train.eval_every=6")
    report = run_training(cfg, t_start=time.perf_counter())
    c = report["compile"]
    assert c["enabled"] and c["reason"] == "requested" and c["status"] == "compiled"
    assert c["recompiles_after_warmup"] == 0 and c["warmup_s"] > 0 and not c["recompile_limit_hit"]
    assert c["cache_dir"] == str(compile_env.resolve())
    warmup = json.loads((Path(report["run_dir"]) / "warmup.json").read_text())
    assert warmup["totals"]["shapes"] == 2 and warmup["cache"]["dir"] == c["cache_dir"]
    assert {(r["batch_size"], r["seq_len"]) for r in warmup["shapes"] if r["phase"] == "eval"} == \
        {(r["batch_size"], r["seq_len"]) for r in warmup["shapes"] if r["phase"] == "train"}
    assert {"compile_s", "steps_to_stability", "steady_step_ms", "cv", "cache"} <= set(warmup["shapes"][0])
    assert report["quality"]["final_train_loss"] is not None


def test_compile_off_by_default_on_cpu(tiny_cfg) -> None:
    report = run_training(tiny_cfg("train.max_steps=2"), t_start=time.perf_counter())
    assert report["compile"]["enabled"] is False and "CPU" in report["compile"]["reason"]
    assert report["compile"]["recompiles_after_warmup"] is None and report["compile"]["unavailable_reason"]


def _warmup_cli(tmp_path: Path, wndb: Path, cache: Path, run_id: str) -> subprocess.Popen:
    root = Path(__file__).resolve().parent.parent
    args = [f"data.wordnet_dir={wndb}", f"data.cache_dir={tmp_path / 'cache'}", "data.vocab_size=200",
            "data.max_len=32", "model.num_layers=1", "model.hidden_size=32", "model.num_heads=2", "model.ffn_size=64",
            f"train.output_dir={tmp_path / 'runs'}", f"compile.cache_dir={cache}", *FEW_SHAPES]
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.Popen([sys.executable, "-m", "train", "warmup", *args, "--run-id", run_id], cwd=root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_two_processes_share_one_cache_and_survive_damaged_entries(tmp_path: Path, wndb: Path) -> None:
    cache = tmp_path / "shared-inductor"
    # prepare the tokenizer once so both processes start compiling at about the same time
    first = _warmup_cli(tmp_path, wndb, tmp_path / "warmup-tok", "tok")
    assert first.wait(timeout=900) == 0, first.stderr.read()
    procs = [_warmup_cli(tmp_path, wndb, cache, f"p{i}") for i in range(2)]
    outs = [p.communicate(timeout=1200) for p in procs]
    for p, (_out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    for i in range(2):
        w = json.loads((tmp_path / "runs" / f"p{i}" / "warmup.json").read_text())
        assert w["restored_bit_exact"] and w["totals"]["shapes"] == 2 and w["cache"]["dir"] == str(cache.resolve())
    # half-written entries (as a crash mid-write would leave them) mean recompiling, never a crash
    damaged = 0
    for f in cache.rglob("*"):
        if f.is_file() and f.stat().st_size > 1 and "lock" not in f.name:
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
            damaged += 1
    assert damaged > 0
    third = _warmup_cli(tmp_path, wndb, cache, "p2")
    _out, err = third.communicate(timeout=1200)
    assert third.returncode == 0, err[-3000:]
    assert json.loads((tmp_path / "runs" / "p2" / "warmup.json").read_text())["restored_bit_exact"]
