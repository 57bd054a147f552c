"""The numerics guard: bad steps skipped and counted, the culprit module named, abort after N (exit 3),
and no host read of a device value on healthy steps."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import CPU, HostReads, batch, small_trainer
from train.clipping import ClipResult
from train.compat import fused_adamw_supported, make_grad_scaler
from train.models.encoder import EncoderClassifier
from train.numerics import NumericsAbort, NumericsGuard
from train.precision import PrecisionPolicy
from train.run.training import run_training


@pytest.mark.skipif(not fused_adamw_supported(CPU), reason="no fused CPU AdamW in this torch (< 2.4)")
@pytest.mark.parametrize("method", ["global-norm", "per-layer-std", "agc", "none"])
def test_healthy_steps_read_nothing_back(method: str) -> None:
    tr = small_trainer(f"clip.method={method}")
    tr.step(batch())  # first step: optimizer state is created
    with HostReads() as reads:
        for i in range(5):
            tr.step(batch(i))
    assert reads.names == [], reads.names  # the guard and clipping stay on the device
    with HostReads() as reads:
        record = tr.guard.end_window(6)
    assert reads.names == ["tolist"]  # one transfer per logged step
    assert record["skipped_steps"] == 0 and record["loss"] > 0 and record["grad_norm"] > 0


@pytest.mark.skipif(not fused_adamw_supported(CPU), reason="no fused CPU AdamW in this torch (< 2.4)")
def test_grad_scaler_steps_read_nothing_back() -> None:
    """fp16's path: GradScaler + fused AdamW pass found_inf on the device (CPU scaler stands in for CUDA's)."""
    try:
        scaler = make_grad_scaler("cpu")
    except RuntimeError:
        pytest.skip("no CPU GradScaler in this torch")
    tr = small_trainer(policy=PrecisionPolicy(mode="fp32", reason="test", device=CPU, scaler=scaler))
    tr.step(batch())
    with HostReads() as reads:
        for i in range(3):
            tr.step(batch(i))
    assert reads.names == [], reads.names


@pytest.mark.parametrize("fused", ["true", "false"])
def test_bad_steps_skipped_and_counted(fused: str) -> None:
    if fused == "true" and not fused_adamw_supported(CPU):
        pytest.skip("no fused CPU AdamW in this torch")
    tr = small_trainer(f"optim.fused={fused}")
    params = lambda: [p.detach().clone() for p in tr.model.parameters()]  # noqa: E731
    tr.step(batch())
    bad_steps = {2, 3, 5}
    for i in range(1, 7):
        before = params()
        with torch.no_grad():
            if i in bad_steps:  # poison one weight for this step only, restore it after
                saved = tr.model.head.bias[0].clone()
                tr.model.head.bias[0] = float("nan")
        tr.step(batch(i))
        if i in bad_steps:
            with torch.no_grad():
                tr.model.head.bias[0] = saved
            assert all(torch.equal(a, b) for a, b in zip(before, params())), "a bad step changed the weights"
        else:
            assert not all(torch.equal(a, b) for a, b in zip(before, params()))
    assert int(tr.optimizer.state[tr.model.head.weight]["step"]) == 1 + 6 - len(bad_steps)
    record = tr.guard.end_window(7)
    assert record["skipped_steps"] == 3 and tr.guard.skipped_steps == 3 and tr.guard.longest_bad_run == 2
    assert record["loss"] is not None and record["loss"] == record["loss"]  # mean over the finite steps


def test_fp16_scaler_skip_is_counted() -> None:
    try:
        scaler = make_grad_scaler("cpu")
    except RuntimeError:
        pytest.skip("no CPU GradScaler in this torch")
    policy = PrecisionPolicy(mode="fp32", reason="test: fp32 compute, fp16-style loss scaling", device=CPU,
                             scaler=scaler)
    tr = small_trainer(policy=policy)
    tr.step(batch())
    scale = scaler.get_scale()
    with torch.no_grad():
        tr.model.head.weight.mul_(1e36)  # logits ~1e36: the scaled loss's gradients overflow
    tr.step(batch(1))
    assert scaler.get_scale() == scale / 2  # the GradScaler skipped the step (and backed off)
    assert tr.guard.end_window(2)["skipped_steps"] == 1


def test_guard_names_the_module_that_produced_inf() -> None:
    tr = small_trainer()
    with torch.no_grad():
        tr.model.layers[0].ffn[0].weight[0, 0] = float("inf")
    tr._last_inputs = (*(batch()[k] for k in ("input_ids", "attention_mask", "labels")), {})
    tr.guard.diagnose_batch(tr._diagnostic_pass)
    assert tr.guard.first_nonfinite["module"] == "layers.0.ffn.0"  # not its parents, not later modules
    assert tr.guard.first_nonfinite["inputs_finite"] is True
    assert "layers.0.ffn.0.weight" in tr.guard.nonfinite_grads


def test_hooks_only_while_diagnosing() -> None:
    tr = small_trainer()
    tr.step(batch())
    assert not any(m._forward_hooks for m in tr.model.modules())
    with torch.no_grad():
        tr.model.tok_emb.weight[batch(1)["input_ids"][0, 0]] = float("inf")
    tr.step(batch(1))
    tr.guard.end_window(2)  # the window had a bad step → armed for the next window
    seen = []
    orig = tr.guard.hooks

    def spy():
        seen.append(True)
        return orig()

    tr.guard.hooks = spy
    tr.step(batch(1))
    assert seen and tr.guard.first_nonfinite["module"] == "tok_emb"
    assert not any(m._forward_hooks for m in tr.model.modules())  # removed after the step


def test_guard_unit_counts_runs() -> None:
    g = NumericsGuard(torch.nn.Linear(1, 1), CPU, max_bad_steps=3)
    seq = [1, 0, 0, 1, 0, 0, 0, 1]  # 1 = finite
    for ok in seq:
        v = torch.tensor(1.0 if ok else float("nan"))
        g.observe(v, ClipResult(torch.tensor(1.0), torch.tensor(0.0)))
    rec = g.end_window(len(seq))
    assert rec["skipped_steps"] == 5 and g.longest_bad_run == 3 and g.should_abort()


def test_abort_after_n_writes_report(tiny_cfg) -> None:
    cfg = tiny_cfg("train.log_every=2", "numerics.max_bad_steps=3", "train.max_steps=20")
    orig = EncoderClassifier.embed

    def broken_embed(self, ids):  # the token embedding starts producing inf after the first step
        if not hasattr(self, "_calls"):
            self._calls = 0
        self._calls += 1
        if self._calls > 1:
            with torch.no_grad():
                self.tok_emb.weight.fill_(float("inf"))
        return orig(self, ids)

    EncoderClassifier.embed = broken_embed
    try:
        with pytest.raises(NumericsAbort) as info:
            run_training(cfg, time.perf_counter())
    finally:
        EncoderClassifier.embed = orig
    assert info.value.exit_code == 3
    report = json.loads((Path(cfg.train.output_dir) / "t" / "report.json").read_text())
    assert report["status"] == "aborted-numerics"
    n = report["numerics"]
    assert n["aborted"] and n["longest_bad_run"] >= 3 and n["aborted_at_step"] == 4
    assert n["first_nonfinite"]["module"] == "tok_emb"
    assert report["perf"]["throughput_valid"] is False and report["perf"]["throughput_samples_per_s"] is None


@pytest.mark.slow  # a subprocess with data prep; test_abort_after_n_writes_report covers it in-process
def test_cli_exits_3_on_diverging_run(wndb: Path, tmp_path: Path) -> None:
    root = Path(__file__).resolve().parent.parent
    args = [f"data.wordnet_dir={wndb}", f"data.cache_dir={tmp_path / 'cache'}", "data.vocab_size=200",
            "data.max_len=32", "model.num_layers=1", "model.hidden_size=32", "model.num_heads=2", "model.ffn_size=64",
            "batching.batch_size=16", "train.max_steps=40", "train.log_every=1", "train.progress=false",
            f"train.output_dir={tmp_path / 'runs'}", "train.run_id=x", "optim.lr=1e36", "optim.warmup_fraction=0",
            "clip.method=none", "numerics.max_bad_steps=3"]
    proc = subprocess.run([sys.executable, "-m", "train", "train", *args], capture_output=True, text=True,
                          cwd=root, timeout=300)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "consecutive steps with non-finite" in proc.stderr
    report = json.loads((tmp_path / "runs" / "x" / "report.json").read_text())
    assert report["status"] == "aborted-numerics" and report["numerics"]["first_nonfinite"] is not None
