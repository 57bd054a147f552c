"""What serving costs besides time: the KV cache's share of memory (from the model's shape, per path) and the energy
per output token (the project's :class:`~train.perf.energy.EnergyMeter`: NVML's energy counter on a GPU, RAPL on a CPU
that exposes it, null with the reason elsewhere)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch

from train.generate.engines import PROMPT_BUCKET, continuous_config


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> Optional[int]:
    """Bytes one token's keys and values take in the cache: 2 × layers × KV heads × head dim × element size
    (grouped-query attention's fewer KV heads included); None for a config without those fields."""
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    if not (layers and heads and hidden):
        return None
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return 2 * layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def kv_cache_tokens(path: str, prompts: list[list[int]], max_new_tokens: int, batch_size: int) -> int:
    """Tokens the cache of ``path`` holds at its largest in the batched run: a ``generate`` batch's rows at their
    longest prompt (rounded up to the bucket for ``static-compile``, whose cache is allocated whole) plus the new
    tokens; continuous batching's paged cache, allocated up front (:func:`continuous_config`)."""
    if path == "continuous":
        import transformers as tf

        cb = continuous_config(tf, prompts, max_new_tokens)
        return int(cb.num_blocks * cb.page_size)
    multiple = PROMPT_BUCKET if path == "static-compile" else 1
    most = 0
    for i in range(0, len(prompts), batch_size):
        longest = max(len(p) for p in prompts[i:i + batch_size])
        width = -(-longest // multiple) * multiple
        most = max(most, min(batch_size, len(prompts) - i) * (width + max_new_tokens))
    return most


def kv_cache(model, paths: list[str], prompts: list[list[int]], max_new_tokens: int, batch_size: int,
             dtype: torch.dtype) -> dict[str, Any]:
    """The KV cache's bytes per token and, per path, at its largest in the batched run (an estimate from the shape:
    the allocators' rounding and fragmentation are not in it)."""
    per = kv_bytes_per_token(model.config, dtype)
    if per is None:
        return {"bytes_per_token": None, "unavailable_reason": "the model's config names no layers/heads/hidden size"}
    return {"bytes_per_token": per,
            "batched_peak_bytes": {p: per * kv_cache_tokens(p, prompts, max_new_tokens, batch_size) for p in paths},
            "method": "2 x layers x KV heads x head dim x element size x tokens held (longest prompt of each batch + "
                      "new tokens; static-compile's prompt bucket; continuous batching's preallocated pages)"}


def energy_per_output_token(device: torch.device, run: Callable[[], int]) -> dict[str, Any]:
    """Joules per output token of ``run()`` (which returns its output tokens), from the energy meter; null with the
    reason where the device has no counter."""
    from train.perf.energy import EnergyMeter
    from train.perf.timer import synchronize

    meter = EnergyMeter(device)
    meter.start()
    tokens = run()
    synchronize(device)
    got = meter.stop()
    if got.get("energy_j") is None:
        return {"energy_j_per_output_token": None, "energy_unavailable_reason": got.get("energy_unavailable_reason")}
    return {"energy_j_per_output_token": got["energy_j"] / max(1, tokens), "energy_source": got.get("energy_source")}
