"""The precision policy: fp16 overflow kept out of the embeddings, no GradScaler for bf16,
gradients unscaled before clipping."""

import warnings

import pytest
import torch

from tests.test_numerics import batch, small_trainer
from train.compat import make_grad_scaler
from train.errors import UserError
from train.model import EncoderClassifier, resolve_spec
from train.precision import PrecisionPolicy

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
    model = EncoderClassifier(resolve_spec("tiny", 20, 3, 8, 0.0, num_layers=1, hidden_size=16, num_heads=2, ffn_size=32))
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
        loss = torch.nn.functional.cross_entropy(tr.model(*batch()[:2], tr.policy.blocks_autocast), batch()[2])
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
    _, norm_ref = ref.train_step(*batch())
    _, norm_scaled = scaled.train_step(*batch())
    assert scaler.get_scale() == 65536.0  # the loss really was scaled
    assert float(norm_scaled) == pytest.approx(float(norm_ref), rel=1e-5)  # true units, not 65536× larger
    assert float(norm_ref) > 0.01  # clipping was active, so the threshold was compared in true units too
    for a, b in zip(ref.model.parameters(), scaled.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
