import torch

from train.models.encoder import EncoderClassifier, resolve_spec
from train.models.flops import training_step_flops


def small_model(pooling: str = "mean") -> EncoderClassifier:
    torch.manual_seed(0)
    spec = resolve_spec("tiny", vocab_size=50, num_classes=7, max_len=40, dropout=0.0, pooling=pooling,
                        num_layers=2, hidden_size=32, num_heads=4, ffn_size=64)
    return EncoderClassifier(spec).eval()


def test_output_shape_and_dtype() -> None:
    model = small_model()
    ids = torch.randint(4, 50, (3, 12))
    logits = model(ids, torch.ones(3, 12, dtype=torch.bool))
    assert logits.shape == (3, 7) and logits.dtype == torch.float32


def test_padding_does_not_change_logits() -> None:
    for pooling in ("mean", "cls"):
        model = small_model(pooling)
        ids = torch.randint(4, 50, (1, 9))
        short = model(ids, torch.ones(1, 9, dtype=torch.bool))
        padded_ids = torch.cat([ids, torch.zeros(1, 23, dtype=torch.long)], dim=1)
        mask = torch.zeros(1, 32, dtype=torch.bool)
        mask[:, :9] = True
        padded = model(padded_ids, mask)
        torch.testing.assert_close(short, padded, rtol=1e-5, atol=1e-5)


def test_mask_matters() -> None:
    """The comparison above would pass trivially if the mask were ignored and padding had no effect."""
    model = small_model()
    ids = torch.cat([torch.randint(4, 50, (1, 9)), torch.randint(4, 50, (1, 23))], dim=1)
    mask = torch.zeros(1, 32, dtype=torch.bool)
    mask[:, :9] = True
    assert not torch.allclose(model(ids, mask), model(ids, torch.ones(1, 32, dtype=torch.bool)))


def test_flops_of_a_linear_layer_match_2mnk() -> None:
    from torch.utils.flop_counter import FlopCounterMode

    lin = torch.nn.Linear(64, 128)
    x = torch.randn(10, 64)
    with FlopCounterMode(display=False) as counter:
        lin(x)
    assert counter.get_total_flops() == 2 * 10 * 64 * 128


def test_training_step_flops_match_the_hand_formula() -> None:
    model = small_model()
    b, s, h, f, layers, c = 4, 16, 32, 64, 2, 7
    ids = torch.randint(4, 50, (b, s))
    mask = torch.ones(b, s, dtype=torch.bool)
    linear_fwd = layers * 2 * b * s * (h * 3 * h + h * h + 2 * h * f) + 2 * b * h * c  # 2·m·n·k per Linear
    attention = layers * 12 * b * s * s * h  # QK^T and A·V: 4·B·S²·H forward, twice that backward
    # every Linear's backward is two matmuls of its forward size (grad input, grad weight)
    assert training_step_flops(model, ids, mask) == 3 * linear_fwd + attention
    assert all(p.grad is None for p in model.parameters())
