"""The probes a causal LM is built with (train/models/causal_build.py): whether its packed rows are exact on each
attention path (:func:`probe_causal_packing`: the block-causal mask, ``varlen``, ``eager-mask``) and whether the
chunked loss can stand in for its head (:func:`probe_loss_head`). Each runs short random inputs in fp32, eval mode,
without gradients, the RNG untouched."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from train.models.causal import EXACT_ATOL, KNOWN_LAYER_TYPES, ExternalCausalLM
from train.models.varlen import register


def _probe_batch(vocab: int, lengths: tuple[int, ...], device: torch.device) -> tuple[list[torch.Tensor], dict]:
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, max(1, vocab), (n,), generator=gen) for n in lengths]
    c = sum(lengths) + 2  # two padding tokens at the end
    ids, pos = torch.zeros(1, c, dtype=torch.long), torch.zeros(1, c, dtype=torch.long)
    seq = torch.full((1, c), -1, dtype=torch.long)
    at = 0
    for k, s in enumerate(seqs):
        ids[0, at:at + len(s)], pos[0, at:at + len(s)], seq[0, at:at + len(s)] = s, torch.arange(len(s)), k
        at += len(s)
    batch = {"input_ids": ids.to(device), "attention_mask": (seq >= 0).to(device), "position_ids": pos.to(device),
             "seq_index": seq.to(device), "num_seqs": len(seqs)}
    return [s.to(device) for s in seqs], batch


@torch.no_grad()
def probe_causal_packing(wrapper: ExternalCausalLM) -> tuple[bool, str]:
    """Run short random samples packed into one row (with padding) and one by one (fp32, eval mode, no grad, RNG
    untouched) and set ``wrapper.supports_packing`` / ``packing_reason``: True only when every real token's logits
    agree within :data:`EXACT_ATOL` (relative to the logits' scale). Refused, with the reason naming the
    architecture: a base model without ``position_ids``, layer types with no known mask (e.g. chunked attention),
    a forward that rejects the 4-D mask, logits that differ. Returns ``(supported, reason)``."""
    from train.models.packed import takes_position_ids

    inner = wrapper.inner
    model_type = getattr(inner.config, "model_type", "?")
    arch = f"{type(inner).__name__} (model_type {model_type}, {wrapper.attn_implementation} attention)"
    why = takes_position_ids(model_type)
    if why is not None:
        return wrapper.set_packing(False, f"{arch}: {why}")
    unknown = [t for t in wrapper.layer_types if t not in KNOWN_LAYER_TYPES]
    if unknown:
        return wrapper.set_packing(False, f"{arch}: layer types {', '.join(unknown)} have no block-causal mask here "
                                          f"(packed: {', '.join(KNOWN_LAYER_TYPES)})")
    lengths: tuple[int, ...] = (5, 3)
    if wrapper.sliding_window is not None and int(wrapper.sliding_window) < 64:  # a window short samples would not see
        lengths = (int(wrapper.sliding_window) + 3, 3)
    device = next(inner.parameters()).device
    seqs, batch = _probe_batch(wrapper.spec.vocab_size, lengths, device)
    was_training = inner.training
    inner.eval()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            ref = [inner(input_ids=s[None], use_cache=False).logits[0].float() for s in seqs]
            try:
                packed = wrapper.packed_logits(batch["input_ids"], batch["position_ids"], batch["seq_index"]).float()
            except (TypeError, ValueError, RuntimeError) as exc:
                text = str(exc).splitlines()[0][:120] if str(exc) else ""
                return wrapper.set_packing(False, f"{arch}: its forward rejects the 4-D block-causal mask "
                                                  f"({type(exc).__name__}: {text})")
            varlen = _varlen_logits(wrapper, batch, arch)
            eager = _eager_logits(wrapper, batch, arch)
    finally:
        inner.train(was_training)
    want = torch.cat(ref)
    scale = max(1.0, float(want.abs().max()))

    def gap_of(packed: torch.Tensor) -> float:
        got = torch.cat([packed[0, sum(lengths[:k]):sum(lengths[:k + 1])] for k in range(len(lengths))])
        return float((got - want).abs().max())

    gap = gap_of(packed)
    if gap <= EXACT_ATOL * scale:
        wrapper.varlen_reason = (varlen if isinstance(varlen, str) else
                                 "exact: each sample's causal attention over itself, samples of similar length "
                                 "batched into SDPA calls" if gap_of(varlen) <= EXACT_ATOL * scale else
                                 f"{arch}: varlen logits differ from unpacked by {gap_of(varlen):.1e}")
        wrapper.eager_reason = (eager if isinstance(eager, str) else
                                "exact: the block-causal mask added to the scores (transformers' eager attention)"
                                if gap_of(eager) <= EXACT_ATOL * scale else
                                f"{arch}: eager-mask logits differ from unpacked by {gap_of(eager):.1e}")
        form = "boolean" if wrapper.attn_implementation == "sdpa" else "additive float"
        return wrapper.set_packing(True, f"{arch}: per-sample positions and a 4-D {form} block-causal mask"
                                         f"{' (+ its sliding window)' if wrapper.sliding_window else ''} (max logit "
                                         f"gap {gap:.1e} vs unpacked)")
    return wrapper.set_packing(False, f"{arch}: packed rows are not exact here (logits differ from unpacked by "
                                      f"{gap:.1e})")


def _varlen_logits(wrapper: ExternalCausalLM, batch: dict, arch: str) -> Any:
    """The probe's packed logits through the ``varlen`` path (train/models/varlen.py), or why it cannot run (a
    str); called inside :func:`probe_causal_packing`'s eval-mode, no-grad, forked-RNG block."""
    if wrapper.sliding_window is not None:
        return f"{arch}: a sliding window (varlen attends over the whole sample): the block mask only"
    try:
        register()
        return wrapper.packed_logits(batch["input_ids"], batch["position_ids"], batch["seq_index"], "varlen").float()
    except (ImportError, AttributeError, KeyError, TypeError, ValueError, RuntimeError) as exc:  # an older transformers
        text = str(exc).splitlines()[0][:120] if str(exc) else ""
        return f"{arch}: the varlen attention does not run here ({type(exc).__name__}: {text})"


def _eager_logits(wrapper: ExternalCausalLM, batch: dict, arch: str) -> Any:
    """The probe's packed logits through the ``eager-mask`` path, or why it is not offered (a str): the model runs
    eager attention already (``sdpa-mask`` is that path), or its forward refuses it."""
    if wrapper.attn_implementation == "eager":
        return f"{arch}: the model's own attention is eager already (sdpa-mask runs the same)"
    try:
        return wrapper.packed_logits(batch["input_ids"], batch["position_ids"], batch["seq_index"],
                                     "eager-mask").float()
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        text = str(exc).splitlines()[0][:120] if str(exc) else ""
        return f"{arch}: the eager attention does not run here ({type(exc).__name__}: {text})"


@torch.no_grad()
def probe_loss_head(wrapper: ExternalCausalLM) -> tuple[bool, str]:
    """Whether the chunked loss can stand in for the model's head: the output layer is an ``nn.Linear`` and, on a
    short random input (fp32, eval mode, RNG untouched), ``head(base_model(x).last_hidden_state)`` equals the model's
    logits within :data:`EXACT_ATOL` (a model that scales or soft-caps its logits after the head does not).
    Returns ``(ok, reason)``."""
    inner = wrapper.inner
    name = f"{type(inner).__name__} (model_type {getattr(inner.config, 'model_type', '?')})"
    head = inner.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        return False, f"{name}: its output layer is {type(head).__name__}, not a linear LM head"
    device = next(inner.parameters()).device
    ids = torch.randint(0, max(1, wrapper.spec.vocab_size), (1, 6), generator=torch.Generator().manual_seed(0))
    was_training = inner.training
    inner.eval()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            hidden = inner.base_model(input_ids=ids.to(device), use_cache=False).last_hidden_state
            logits = inner(input_ids=ids.to(device), use_cache=False).logits.float()
    finally:
        inner.train(was_training)
    gap = float((head(hidden).float() - logits).abs().max())
    if gap > EXACT_ATOL * max(1.0, float(logits.abs().max())):
        return False, f"{name}: its logits are not its head applied to the last hidden states (gap {gap:.1e})"
    return True, f"{name}: a linear LM head over the last hidden states (gap {gap:.1e})"
