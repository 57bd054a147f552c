"""Each clipping method against numbers computed by hand; norms are pre-clip and in true units."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from train.clipping import clip_gradients
from train.config import load_config
from train.errors import UserError


def params_with_grads(*pairs):
    out = []
    for w, g in pairs:
        p = torch.nn.Parameter(torch.tensor(w, dtype=torch.float32))
        p.grad = torch.tensor(g, dtype=torch.float32)
        out.append(p)
    return out


def test_global_norm_by_hand() -> None:
    # ‖[3, 4]‖ = 5, ‖[0, 0, 12]‖ = 12 → global norm 13; max_norm 6.5 halves every gradient
    ps = params_with_grads(([0.0, 0.0], [3.0, 4.0]), ([0.0, 0.0, 0.0], [0.0, 0.0, 12.0]))
    r = clip_gradients(ps, "global-norm", max_norm=6.5)
    assert float(r.grad_norm) == pytest.approx(13.0)
    assert ps[0].grad.tolist() == pytest.approx([1.5, 2.0], rel=1e-6)
    assert ps[1].grad.tolist() == pytest.approx([0.0, 0.0, 6.0], rel=1e-6)
    assert float(r.clipped_fraction) == 1.0
    ps = params_with_grads(([0.0, 0.0], [3.0, 4.0]))
    r = clip_gradients(ps, "global-norm", max_norm=10.0)  # under the threshold: untouched
    assert ps[0].grad.tolist() == [3.0, 4.0] and float(r.clipped_fraction) == 0.0


def test_per_layer_std_by_hand() -> None:
    # g = nine 0s and one 10: mean 1, population σ = sqrt((9·1 + 81) / 10) = 3 → clamp at ±2.5·3 = ±7.5
    g = [0.0] * 9 + [10.0]
    # h = [1, -1, 1, -1]: σ = 1 → ±2.5, nothing clamped; a 1-element gradient is left alone
    ps = params_with_grads(([0.0] * 10, g), ([0.0] * 4, [1.0, -1.0, 1.0, -1.0]), ([0.0], [50.0]))
    r = clip_gradients(ps, "per-layer-std", std_k=2.5)
    assert float(r.grad_norm) == pytest.approx(math.sqrt(100 + 4 + 2500))
    assert ps[0].grad.tolist() == pytest.approx([0.0] * 9 + [7.5])
    assert ps[1].grad.tolist() == [1.0, -1.0, 1.0, -1.0]
    assert ps[2].grad.tolist() == [50.0]
    assert float(r.clipped_fraction) == pytest.approx(1 / 15)


def test_agc_by_hand() -> None:
    # W rows have norms 5 and 1; G rows 0.5 and 0.001. λ = 0.01: allowed 0.05 and 0.01.
    # Row 0: 0.5 > 0.05 → scaled by 0.05 / 0.5 = 0.1. Row 1: kept. Bias [0, 0] (norm 0 → ε = 1e-3 → allowed 1e-5):
    # its gradient [3e-5, 4e-5] (norm 5e-5) is scaled to norm 1e-5.
    ps = params_with_grads(([[3.0, 4.0], [0.0, 1.0]], [[0.3, 0.4], [0.0, 0.001]]), ([0.0, 0.0], [3e-5, 4e-5]))
    r = clip_gradients(ps, "agc", agc_lambda=0.01, agc_eps=1e-3)
    assert float(r.grad_norm) == pytest.approx(math.sqrt(0.25 + 1e-6 + 25e-10))
    assert ps[0].grad.flatten().tolist() == pytest.approx([0.03, 0.04, 0.0, 0.001], rel=1e-5)
    assert ps[1].grad.tolist() == pytest.approx([0.6e-5, 0.8e-5], rel=1e-4)
    assert float(r.clipped_fraction) == pytest.approx(4 / 6)  # row 0 (2 elements) + the bias (2) of 6


def test_none_reports_norm_and_changes_nothing() -> None:
    ps = params_with_grads(([0.0, 0.0], [3.0, 4.0]))
    r = clip_gradients(ps, "none")
    assert float(r.grad_norm) == 5.0 and ps[0].grad.tolist() == [3.0, 4.0] and float(r.clipped_fraction) == 0.0


def test_nonfinite_gradient_gives_nonfinite_norm() -> None:
    for method in ("global-norm", "per-layer-std", "agc", "none"):
        ps = params_with_grads(([1.0, 1.0], [float("inf"), 1.0]))
        assert not torch.isfinite(clip_gradients(ps, method).grad_norm)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(-1e3, 1e3, allow_nan=False), min_size=2, max_size=40), st.floats(0.1, 100.0))
def test_global_norm_matches_torch(values, max_norm) -> None:
    a = params_with_grads(([0.0] * len(values), values))
    b = params_with_grads(([0.0] * len(values), values))
    r = clip_gradients(a, "global-norm", max_norm=max_norm)
    ref = torch.nn.utils.clip_grad_norm_(b, max_norm)
    assert float(r.grad_norm) == pytest.approx(float(ref), rel=1e-5, abs=1e-6)
    assert torch.allclose(a[0].grad, b[0].grad, rtol=1e-5, atol=1e-6)
    assert float(torch.linalg.vector_norm(a[0].grad)) <= max_norm * (1 + 1e-5) + 1e-6


def test_clip_config_and_legacy_clip_norm() -> None:
    cfg = load_config(None, ["optim.clip_norm=0.5"])  # old name still works
    assert cfg.clip.max_norm == 0.5 and cfg.optim.clip_norm == 0.5
    cfg = load_config(None, ["clip.method=agc"])
    assert cfg.optim.clip_norm is None  # mirrors: no global-norm threshold in effect
    with pytest.raises(UserError, match="disagree"):
        load_config(None, ["optim.clip_norm=0.5", "clip.max_norm=2.0"])
    with pytest.raises(UserError, match="clip.method"):
        load_config(None, ["clip.method=adaptive"])
