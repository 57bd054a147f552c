"""``model.source=python:package.module:function``: any ``nn.Module`` from a factory function.

The contract (docs/models.md):

* the factory is called with keyword arguments ``num_classes`` (int, the data's classes), ``vocab_size`` (int,
  the tokenizer's vocabulary: token ids are in ``[0, vocab_size)``) and ``max_len`` (int, ``data.max_len``: no
  batch is longer) and returns an ``nn.Module``;
* its ``forward(input_ids, attention_mask)`` takes LongTensor[B, S] and BoolTensor[B, S] (True = real token;
  padding is at the end) and returns logits FloatTensor[B, num_classes] (any float dtype; cast to fp32);
* weights come from torch's RNG, seeded by ``train.seed`` (load your own inside the factory if you want).

Before training two probe forwards, on batches of 2 × 4 tokens and of 2 × the longest length the run will use
(``data.max_len``, or the largest bucket bound if that is longer), check that the module runs and the shape of the
logits, so a factory that does not fit (e.g. a position table shorter than ``max_len``) fails at once with one line,
not in the middle of the first step.
"""

from __future__ import annotations

import importlib
import sys

import torch
from torch import nn

from train.errors import UserError
from train.models.wrap import ExternalClassifier, ExternalSpec


def _factory(source: str):
    _, module_name, func_name = source.split(":")
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")  # the working directory, as `python -m` does
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's module: one line
        raise UserError(f"model.source={source}: cannot import {module_name!r} ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
    fn = getattr(module, func_name, None)
    if not callable(fn):
        raise UserError(f"model.source={source}: {module_name} has no function {func_name!r}")
    return fn


def build_custom(cfg, bundle) -> ExternalClassifier:
    """The wrapped module from the ``python:`` factory, probed once (see the module docstring).

    Raises:
        UserError: the module does not import, the function is missing, the factory fails or returns no
            ``nn.Module``, or a probe forward (2 × 4 tokens, 2 × the longest length) fails or returns another
            shape than [2, num_classes].
    """
    source = cfg.model.source
    fn = _factory(source)
    n, v, max_len = bundle.num_classes, bundle.vocab_size, cfg.data.max_len
    try:
        inner = fn(num_classes=n, vocab_size=v, max_len=max_len)
    except Exception as exc:  # noqa: BLE001
        raise UserError(f"model.source={source}: the factory failed when called with num_classes={n}, vocab_size={v}, "
                        f"max_len={max_len} ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
    if not isinstance(inner, nn.Module):
        raise UserError(f"model.source={source}: the factory returned {type(inner).__name__}, not a torch.nn.Module")
    longest = max([max_len, *(bundle.bounds or ())])  # no batch of this run is longer (bucket bounds ≤ data.max_len)
    for s in sorted({min(4, longest), longest}):  # a short batch, then the longest the run will use
        _probe(source, inner, n, v, s)
    spec = ExternalSpec(source=source, num_classes=n, vocab_size=v, max_len=max_len,
                        hidden_size=int(getattr(inner, "hidden_size", 0) or 0))
    return ExternalClassifier(inner, spec, "python")


def _probe(source: str, inner: nn.Module, n: int, v: int, s: int) -> None:
    """One no-grad eval-mode forward of ``inner`` on LongTensor[2, s] ids (row 1 padded at its last token).

    Raises:
        UserError: the forward fails, or returns anything but float logits of shape [2, n].
    """
    ids = torch.randint(0, v, (2, s), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, s, dtype=torch.bool)
    mask[1, -1] = False
    was = inner.training
    inner.eval()
    try:
        with torch.no_grad():
            out = inner(ids, mask)
    except Exception as exc:  # noqa: BLE001
        raise UserError(f"model.source={source}: forward(input_ids LongTensor[2, {s}], attention_mask "
                        f"BoolTensor[2, {s}]) failed ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0] if str(exc) else ''}); it must return "
                        f"logits [B, num_classes] for every length up to data.max_len") from None
    finally:
        inner.train(was)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, n) or not out.is_floating_point():
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise UserError(f"model.source={source}: forward returned {got}, expected float logits of shape (2, {n}) "
                        f"for a batch of 2 × {s} tokens")
