"""The floors of generation: how fast the machine's memory and arithmetic could serve this model at best.

**Decode.** A decode step reads every weight once (in the serving dtype) and, for each request of the batch, its keys
and values up to the current length; it cannot take less than those bytes over the memory bandwidth. At batch B the
step is (weight bytes + B × KV bytes of a request) / bandwidth, and a request's TPOT is that step: its **floor**. A
path's TPOT p50 divided by its floor says how far from the memory it runs (1.0: at the bandwidth; below 1.0 the weights
were served from the CPU's caches, which a large copy does not measure). The KV bytes are at the cache's mean length
over a request's decode steps (mean prompt + (new tokens - 1) / 2). An untied input embedding is left out of the weight
bytes (a step gathers one row of it), a tied one is counted once, as the output head's matrix.

**Prefill** against the matmul peak: 2 × parameters FLOPs per prompt token (the forward pass's 2N per token of
Kaplan et al. 2020, "Scaling Laws for Neural Language Models"; attention's share left out) over the peak FLOP/s in the
serving dtype, for the mean prompt of one request: the TTFT floor.

The peaks are measured in the run (:func:`train.profiling.roofline.measure_peaks`: a copy of at least twice the
weight bytes, counted read + write, and a large matmul), or read from the device table for a listed GPU.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from train.generate.resources import kv_bytes_per_token

_MIB = 2**20


def weight_bytes_read(model: torch.nn.Module) -> int:
    """Bytes a decode step reads of the weights: each parameter tensor once (tied weights share one storage), less
    an input embedding table that is not also the output head (int, bytes)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        ptr = p.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            total += p.numel() * p.element_size()
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if emb is not None and (head is None or emb.weight.untyped_storage().data_ptr()
                            != head.weight.untyped_storage().data_ptr()):
        total -= emb.weight.numel() * emb.weight.element_size()
    return total


def peaks_for(model: torch.nn.Module, device: torch.device, device_name: str) -> dict[str, Any]:
    """The bandwidth (bytes/s) and matmul peak (FLOP/s) the floors divide by, in the model's dtype, with their
    source: the device table's row for a listed GPU, else measured here."""
    from train.perf.devices import table_entry
    from train.profiling.roofline import measure_peaks

    dtype = next(model.parameters()).dtype
    copy = min(2**30, max(64 * _MIB, 2 * weight_bytes_read(model)))
    measured = measure_peaks(device, dtype, copy_bytes=copy)
    out = {"measured_bytes_per_s": measured["bytes_per_s"], "measured_flops_per_s": measured["flops_per_s"],
           "copy_bytes": measured["copy_bytes"], "matmul_n": measured["matmul_n"]}
    row = table_entry(device_name) if device.type == "cuda" else None
    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")
    if row is not None and name in row:
        return {**out, "bytes_per_s": row["bandwidth_bytes_per_s"], "flops_per_s": row[name],
                "source": f"device table ({device_name}, {name})"}
    return {**out, "bytes_per_s": measured["bytes_per_s"], "flops_per_s": measured["flops_per_s"],
            "source": f"measured here ({dtype}): a {measured['copy_bytes'] // _MIB} MiB copy (read + write) and a "
                      f"{measured['matmul_n']}² matmul"}


def generation_floor(model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int, batch_size: int,
                     peaks: dict[str, Any]) -> dict[str, Any]:
    """generate.json's ``floor`` (module docstring): the bytes a decode step reads, the TPOT floor (ms) at batch 1 and
    at ``batch_size``, and the TTFT floor (ms) of one mean prompt's prefill, from ``peaks`` (:func:`peaks_for`).
    The KV part is null, with ``kv_unavailable_reason``, for a config without layers/heads/hidden size."""
    dtype = next(model.parameters()).dtype
    weights = weight_bytes_read(model)
    mean_prompt = sum(len(p) for p in prompts) / max(1, len(prompts))
    per_token = kv_bytes_per_token(model.config, dtype)
    kv = None if per_token is None else per_token * (mean_prompt + (max_new_tokens - 1) / 2)
    bw, flops = peaks["bytes_per_s"], peaks["flops_per_s"]

    def tpot(b: int) -> float:
        return (weights + b * (kv or 0.0)) / bw * 1e3

    params = sum(p.numel() for p in {p.untyped_storage().data_ptr(): p for p in model.parameters()}.values())
    out: dict[str, Any] = {
        "weight_bytes_per_step": weights, "kv_bytes_per_request_step": kv, "bandwidth_bytes_per_s": bw,
        "tpot_floor_ms": {"single": tpot(1), "batched": tpot(batch_size)}, "batch_size": batch_size,
        "prefill_flops": 2.0 * params * mean_prompt, "peak_flops_per_s": flops,
        "ttft_floor_ms": 2.0 * params * mean_prompt / flops * 1e3, "peaks": peaks,
        "method": "TPOT floor: (weight bytes + batch x KV bytes at the mean cache length) / bandwidth; TTFT floor: "
                  "2 x parameters x mean prompt tokens / peak FLOP/s (train/generate/floor.py)"}
    if per_token is None:
        out["kv_unavailable_reason"] = "the model's config names no layers/heads/hidden size: weights only"
    return out


def times_floor(figures: dict[str, Any], floor_ms: Optional[float]) -> Optional[float]:
    """A run's TPOT p50 as a multiple of ``floor_ms`` (None where either is missing)."""
    tpot = (figures.get("tpot_ms") or {}).get("p50")
    return None if tpot is None or not floor_ms else tpot / floor_ms
