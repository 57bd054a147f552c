"""The precision policy: fp16 overflow kept out of the embeddings, no GradScaler for bf16,
gradients unscaled before clipping."""

import json
import os
import time
import warnings
from pathlib import Path

import pytest
import torch

from tests.conftest import batch, small_trainer
from train.compat import make_grad_scaler
from train.errors import UserError
from train.models.encoder import EncoderClassifier, resolve_spec
from train.precision import (
    BF16_MARGIN,
    PROBE_MAX_TOKENS,
    PrecisionPolicy,
    ProbeShape,
    decide,
    machine_fingerprint,
    measure_bf16_speedup,
    probe_for,
)

CPU = torch.device("cpu")
FP16_MAX = torch.finfo(torch.float16).max  # 65504


def cpu_fp16_autocast_works() -> bool:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.autocast("cpu", dtype=torch.float16):
                return torch.ones(2, 2).matmul(torch.ones(2, 2)).dtype == torch.float16
    except RuntimeError:  # torch 2.1: "AutocastCPU only support Bfloat16"
        return False


def overflowing_model() -> tuple[EncoderClassifier, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = EncoderClassifier(resolve_spec("tiny", 20, 3, 8, 0.0, num_layers=1, hidden_size=16, num_heads=2,
                                           ffn_size=32))
    with torch.no_grad():  # each table fits fp16, their sum (the embedding output) does not
        model.tok_emb.weight.fill_(40000.0)
        model.pos_emb.weight.fill_(40000.0)
        model.tok_emb.weight[:, ::2] *= -1  # keep a spread so LayerNorm has something to normalise
    model.eval()
    ids = torch.randint(0, 20, (2, 8))
    return model, ids, torch.ones(2, 8, dtype=torch.bool)


def test_fp16_overflow_stays_out_of_the_embeddings() -> None:
    model, ids, mask = overflowing_model()
    with torch.no_grad():
        emb_out = model.tok_emb(ids) + model.pos_emb(torch.arange(8))
        assert emb_out.abs().max() > FP16_MAX  # the embedding output really exceeds fp16's range
        # the policy: embeddings in fp32, blocks in fp16, head and loss in fp32
        if cpu_fp16_autocast_works():
            policy = PrecisionPolicy(mode="fp16", reason="test", device=CPU)
            logits = model(ids, mask, policy.blocks_autocast)
        else:  # torch 2.1: no fp16 autocast (nor fp16 LayerNorm) on CPU → emulate fp16's range in the blocks
            handles = [m.register_forward_hook(lambda m, i, o: o.half().float()) for m in model.layers.modules()]
            logits = model(ids, mask)
            for h in handles:
                h.remove()
        assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
        # naive whole-model fp16, emulated with explicit casts: the embedding sum overflows to inf ...
        naive_emb = model.tok_emb.weight.half()[ids] + model.pos_emb.weight.half()[torch.arange(8)]
        assert torch.isinf(naive_emb).any()
        # ... and the rest of the forward turns it into NaN
        naive_logits = model.pool_and_classify(model.encode(model.emb_norm(naive_emb.float()), mask), mask)
        assert not torch.isfinite(naive_logits).all()
        try:  # the real thing where CPU has fp16 kernels (torch ≥ 2.2): embeddings, LayerNorm, blocks in fp16
            model.half()
            h = model.encode(model.embed(ids), mask)
        except RuntimeError:
            h = None
        model.float()
        if h is not None:
            assert h.dtype == torch.float16 and not torch.isfinite(model.pool_and_classify(h, mask)).all()


def test_no_grad_scaler_for_bf16_or_fp32() -> None:
    assert PrecisionPolicy.create("bf16", CPU).scaler is None
    assert PrecisionPolicy.create("fp32", CPU).scaler is None
    with pytest.raises(UserError, match="fp16 needs a CUDA device"):
        PrecisionPolicy.create("fp16", CPU)


def test_bf16_backward_is_unscaled() -> None:
    """bf16 gradients come straight from backward (no scale factor): same as fp32 within bf16 precision."""
    grads = {}
    for mode in ("fp32", "bf16"):
        tr = small_trainer(policy=PrecisionPolicy(mode=mode, reason="test", device=CPU))
        loss = torch.nn.functional.cross_entropy(tr.model(batch()["input_ids"], batch()["attention_mask"],
                                                          tr.policy.blocks_autocast), batch()["labels"])
        tr.policy.backward(loss)
        grads[mode] = torch.cat([p.grad.flatten() for p in tr.model.parameters()])
    rel = (grads["bf16"] - grads["fp32"]).norm() / grads["fp32"].norm()
    assert rel < 0.05, float(rel)  # a missing/extra 65536× scale would be off by orders of magnitude


def test_unscale_before_clip_norm_in_true_units() -> None:
    try:
        scaler = make_grad_scaler("cpu")
    except RuntimeError:
        pytest.skip("no CPU GradScaler in this torch (2.1 has one for CUDA only)")
    ref = small_trainer("clip.max_norm=0.01", policy=PrecisionPolicy(mode="fp32", reason="ref", device=CPU))
    scaled = small_trainer("clip.max_norm=0.01",
                           policy=PrecisionPolicy(mode="fp32", reason="scaled", device=CPU, scaler=scaler))
    norm_ref = ref.step(batch()).grad_norm
    norm_scaled = scaled.step(batch()).grad_norm
    assert scaler.get_scale() == 65536.0  # the loss really was scaled
    assert float(norm_scaled) == pytest.approx(float(norm_ref), rel=1e-5)  # true units, not 65536× larger
    assert float(norm_ref) > 0.01  # clipping was active, so the threshold was compared in true units too
    for a, b in zip(ref.model.parameters(), scaled.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# -- precision=auto on a CPU: the rule, the measurement, the per-machine cache, resume ----------------------

def _forced(monkeypatch: pytest.MonkeyPatch, native: bool, ratio: float) -> list:
    calls: list = []

    def measured(probe, repeats=9):
        calls.append(probe)
        return {"fp32_ms": ratio, "bf16_ms": 1.0, "ratio": ratio, "repeats": repeats}

    monkeypatch.setattr("train.precision.cpu_native_bf16", lambda: native)
    monkeypatch.setattr("train.precision.measure_bf16_speedup", measured)
    monkeypatch.setattr("train.precision.machine_load", lambda: 0.0)  # a quiet machine: measured decisions are cached
    return calls


def test_auto_without_native_bf16_is_fp32_by_rule_and_measures_nothing(monkeypatch, tmp_path) -> None:
    calls = _forced(monkeypatch, native=False, ratio=9.0)
    d = decide("auto", CPU, ProbeShape(64, 32, 64), str(tmp_path))
    assert (d.mode, d.source, d.measurement) == ("fp32", "rule", None) and "no native bf16" in d.reason
    assert calls == [] and not (tmp_path / "decisions").exists()


@pytest.mark.parametrize(("ratio", "mode"), [(3.0, "bf16"), (BF16_MARGIN + 0.01, "bf16"), (BF16_MARGIN - 0.01, "fp32"),
                                             (0.5, "fp32")])
def test_auto_with_native_bf16_needs_the_margin(monkeypatch, tmp_path, ratio: float, mode: str) -> None:
    _forced(monkeypatch, native=True, ratio=ratio)
    d = decide("auto", CPU, ProbeShape(64, 32, 64), str(tmp_path))
    assert (d.mode, d.source) == (mode, "measured") and d.measurement["ratio"] == ratio
    assert "[64x32]@[32x64]" in d.reason


def test_measured_decision_is_cached_per_machine(monkeypatch, tmp_path) -> None:
    calls = _forced(monkeypatch, native=True, ratio=3.0)
    probe = ProbeShape(64, 32, 64)
    first = decide("auto", CPU, probe, str(tmp_path))
    again = [decide("auto", CPU, probe, str(tmp_path)) for _ in range(3)]
    assert len(calls) == 1 and first.source == "measured" and first.cache_path
    assert all((d.mode, d.source, d.cache_path) == ("bf16", "cached", first.cache_path) for d in again)
    assert "cached" in again[0].reason and first.cache_path in again[0].reason
    record = json.loads(Path(first.cache_path).read_text())
    assert record["fingerprint"] == machine_fingerprint(probe) and record["mode"] == "bf16"
    # another probe shape (another model or token budget) or thread count is another machine state: measured anew
    decide("auto", CPU, ProbeShape(128, 32, 64), str(tmp_path))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        decide("auto", CPU, probe, str(tmp_path))
    finally:
        torch.set_num_threads(threads)
    assert len(calls) == 3
    # without a cache directory nothing is written and every call measures
    decide("auto", CPU, probe, None)
    assert len(calls) == 4


def test_corrupt_cache_entry_is_measured_again(monkeypatch, tmp_path) -> None:
    calls = _forced(monkeypatch, native=True, ratio=3.0)
    path = Path(decide("auto", CPU, ProbeShape(64, 32, 64), str(tmp_path)).cache_path)
    path.write_text("{not json")
    assert decide("auto", CPU, ProbeShape(64, 32, 64), str(tmp_path)).source == "measured" and len(calls) == 2


def test_probe_is_the_runs_ffn_matmul_at_its_token_budget() -> None:
    from train.config import load_config

    assert probe_for(load_config(None, ["model.preset=tiny", "batching.max_tokens=1024"])) == \
        ProbeShape(1024, 256, 1024)
    assert probe_for(load_config(None, ["model.preset=small", "batching.max_tokens=null", "batching.batch_size=4",
                                        "data.max_len=64"])) == ProbeShape(256, 512, 2048)
    big = probe_for(load_config(None, ["model.hidden_size=96", "model.ffn_size=200", "batching.max_tokens=100000"]))
    assert big == ProbeShape(PROBE_MAX_TOKENS, 96, 200)


def test_real_probe_measures_both_dtypes() -> None:
    m = measure_bf16_speedup(ProbeShape(32, 16, 32), repeats=3)
    assert m["fp32_ms"] > 0 and m["bf16_ms"] > 0 and m["ratio"] == pytest.approx(m["fp32_ms"] / m["bf16_ms"])
    assert m["repeats"] == 3  # which dtype is faster depends on the CPU: not asserted


def test_resume_keeps_the_checkpoints_precision(monkeypatch, tmp_path) -> None:
    from train.config import load_config

    calls = _forced(monkeypatch, native=False, ratio=3.0)
    cfg = load_config(None, [f"data.cache_dir={tmp_path}"])
    saved = {"mode": "bf16", "reason": "auto: measured 3.00x", "source": "measured"}
    p = PrecisionPolicy.for_resume(saved, cfg, CPU, "checkpoint c.pt")  # auto here would say fp32: bf16 it stays
    assert (p.mode, p.source) == ("bf16", "checkpoint") and "measured 3.00x" in p.reason and calls == []
    cfg.train.precision = "fp32"
    with pytest.raises(UserError, match="trained in bf16 but train.precision=fp32"):
        PrecisionPolicy.for_resume(saved, cfg, CPU, "checkpoint c.pt")
    cfg.train.precision = "auto"
    with pytest.raises(UserError, match="trained in fp16, which this device cannot continue"):
        PrecisionPolicy.for_resume({"mode": "fp16", "reason": "x", "source": "rule"}, cfg, CPU, "checkpoint c.pt")
    assert PrecisionPolicy.for_resume(None, cfg, CPU, "checkpoint c.pt").source == "rule"  # an older checkpoint


def test_precision_command_reports_and_remeasures(monkeypatch, tmp_path, capsys) -> None:
    from train.cli import main

    calls = _forced(monkeypatch, native=True, ratio=2.0)
    args = ["precision", f"data.cache_dir={tmp_path}", "model.hidden_size=32", "model.ffn_size=64"]
    assert main(args) == 0 and main(args) == 0 and main(args + ["--remeasure"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[2] for line in out] == ["[measured]", "[cached]", "[measured]"] and len(calls) == 2
    assert all(line.startswith("precision bf16 ") for line in out)


def test_a_decision_measured_on_a_busy_machine_is_not_cached(monkeypatch, tmp_path) -> None:
    calls = _forced(monkeypatch, native=True, ratio=3.0)
    monkeypatch.setattr("train.precision.machine_load", lambda: 64.0)  # far above any core count
    monkeypatch.setattr("train.tools.decisions.cpu_used_elsewhere", lambda: 64.0)  # other processes still running
    busy = decide("auto", CPU, ProbeShape(64, 32, 64), str(tmp_path))
    assert busy.source == "measured" and busy.cache_path is None and "not cached: the machine was busy" in busy.reason
    assert "using 64.0 cores" in busy.reason
    # the load average lags a minute: right after another run ended it is still high, but nothing else runs now
    monkeypatch.setattr("train.tools.decisions.cpu_used_elsewhere", lambda: 0.1)
    lagging = decide("auto", CPU, ProbeShape(64, 32, 64), str(tmp_path / "lag"))
    assert lagging.cache_path and "not cached" not in lagging.reason
    monkeypatch.setattr("train.precision.machine_load", lambda: 0.0)
    quiet = decide("auto", CPU, ProbeShape(64, 32, 64), str(tmp_path))
    assert quiet.source == "measured" and quiet.cache_path and len(calls) == 3
    assert decide("auto", CPU, ProbeShape(64, 32, 64), str(tmp_path)).source == "cached"


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="reads /proc/stat (Linux)")
def test_cpu_used_elsewhere_sees_another_process_spinning(monkeypatch) -> None:
    """The busy check behind every cached decision counts other processes' CPU time now, not the lagging load
    average: a process spinning beside this one shows up as most of a core."""
    import subprocess
    import sys

    from train.tools import decisions

    monkeypatch.setattr(decisions, "_others", {})
    spin = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time() + 5\nwhile time.time() < t: pass"])
    try:
        time.sleep(0.3)  # started and spinning
        assert decisions.cpu_used_elsewhere(0.5) >= 0.6
    finally:
        spin.kill()
        spin.wait()
