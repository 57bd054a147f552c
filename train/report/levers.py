"""report.json ``model`` and ``levers``: which model ran, and for every lever whether it applied and why (not)."""

from __future__ import annotations

from typing import Any, Optional

from train.compat import local_tensor
from train.config.source import source_kind
from train.models.block_checkpoint import OFF_REASON

BUCKETED = ("optimal", "quantile", "kmeans")



def model_section(cfg, model, optimizer=None, peak: Optional[dict] = None,
                  activations: Optional[int] = None) -> dict[str, Any]:
    """report.json ``model``: ``source``, ``class`` (the module that ran), ``parameters`` (count), ``preset``
    (builtin and ``hf:<model_type>`` sizes), ``hf_model_type`` (``hf:`` sources, else null), ``adapter``
    (``model.adapter``'s block: type, r, targets, trainable parameters and their share; null for full fine-tuning)
    and ``memory`` (:func:`memory_split`)."""
    inner = getattr(model, "inner", model)
    hf_type = getattr(getattr(inner, "config", None), "model_type", None)
    return {"source": cfg.model.source, "class": type(inner).__name__,
            "parameters": sum(p.numel() for p in model.parameters()),
            "preset": cfg.model.preset if source_kind(cfg.model.source) in ("builtin", "hf-type") else None,
            "hf_model_type": hf_type, "adapter": getattr(model, "adapter_info", None),
            "memory": memory_split(model, optimizer, peak, activations)}


def memory_split(model, optimizer=None, peak: Optional[dict] = None, activations: Optional[int] = None) -> dict:
    """Bytes of the frozen weights, the trainable weights and the optimizer state (every tensor of its state:
    AdamW's two moments and step), counted from the tensors themselves, and of the activations: on CUDA the peak
    allocated by torch less those three (gradients are as large as the trainable weights and counted with them);
    elsewhere ``activations`` (the bytes autograd saved in the first step's first micro-batch,
    :class:`~train.perf.memory.SavedTensorMeter`), null with ``activations_reason`` where it was not measured (a
    compiled step). ``tensor_bytes``: weights + gradients + optimizer state + activations, what the backward holds
    at its start (the figure to compare LoRA with full fine-tuning on a CPU, whose peak RSS also holds the
    interpreter, the libraries and the prepared data), null where a part is. Under ``dist.strategy=fsdp``: what
    this rank holds (its shards; rank 0 writes the report)."""
    seen: set[int] = set()
    frozen = trainable = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        size = local_tensor(p).numel() * p.element_size()  # fsdp: this rank's shard
        trainable, frozen = (trainable + size, frozen) if p.requires_grad else (trainable, frozen + size)
    opt = None
    if optimizer is not None:
        opt = sum(local_tensor(t).numel() * t.element_size() for st in optimizer.state.values() for t in st.values()
                  if hasattr(t, "numel") and t.dim() > 0)
    out: dict[str, Any] = {"frozen_weights_bytes": frozen, "trainable_weights_bytes": trainable,
                           "gradients_bytes": trainable, "optimizer_state_bytes": opt,
                           "activations_bytes": None, "activations_reason": None}
    peak = peak or {}
    if peak.get("peak_memory_source", "").startswith("torch.cuda") and opt is not None:
        out["activations_bytes"] = max(0, int(peak["peak_memory_bytes"]) - frozen - 2 * trainable - opt)
        out["activations_reason"] = "peak allocated less weights, gradients and optimizer state"
    elif activations is not None:
        out["activations_bytes"] = activations
        out["activations_reason"] = ("saved for the backward by the first step's first micro-batch (autograd's "
                                     "saved-tensor hooks; a checkpointed block's kept inputs not seen)")
    else:
        out["activations_reason"] = ("not measured: the step was compiled, or its forward refuses saved-tensor hooks "
                                     "(torch.func); the peak is the process's resident memory, not torch's")
    parts = (frozen, 2 * trainable, opt, out["activations_bytes"])
    out["tensor_bytes"] = None if None in parts else sum(parts)
    return out


def _yaml(v: Any) -> str:
    """A config value as YAML writes it (``null``, not ``None``). Not train.config.hf_aliases' twin: train.config
    imports this package, so importing it here would make a cycle."""
    return "null" if v is None else str(v)


def _lever(applied: bool, reason: str) -> dict[str, Any]:
    return {"applied": bool(applied), "reason": reason}


def _bench_lever(cfg, bench_rows: dict[str, Optional[str]]) -> dict[str, Any]:
    """``levers.bench``: which ``make bench`` rows run on this model, and why the others do not (rows of packed batches
    need ``supports_packing``). ``bench_rows``: every row → why it cannot run here, or None (the rule ``make bench``
    itself applies: ``train.bench.training.skip_reasons``, handed in by the command)."""
    skipped = {n: why for n, why in bench_rows.items() if why is not None}
    rows = [n for n in bench_rows if n not in skipped]
    reason = f"make bench ARGS=\"model.source={cfg.model.source}\" runs the rows {', '.join(rows)}"
    if skipped:
        reason += (f"; not {', '.join(skipped)}: packed batches, which this model cannot run (supports_packing is "
                   "false: no per-sample positions or block-diagonal mask), skipped with a notice")
    return _lever(bool(rows), reason)


def levers_section(cfg, model, policy, compiled, ctx, profiled: bool,
                   bench_rows: dict[str, Optional[str]]) -> dict[str, dict[str, Any]]:
    """report.json ``levers``: each lever ``{"applied": bool, "reason": str}``.

    ``policy``: the run's PrecisionPolicy; ``compiled``: its CompileSession; ``ctx``: its DistContext;
    ``profiled``: the run is under ``python -m train profile`` (attribution table written). ``bench`` says which
    ``make bench`` rows apply to this model and why not the others.
    """
    b, external = cfg.batching, cfg.model.source != "builtin"
    where = "autocast around the whole forward of the wrapped model (parameters fp32; loss fp32, outside)" if external \
        else "autocast around the encoder blocks (embeddings, pooling, head and loss fp32)"
    attention = {"varlen": "each sample's attention over itself (varlen)", "flex": "FlexAttention's block mask",
                 "eager-mask": "block-diagonal mask in eager attention"}.get(
        getattr(model, "packed_attention", None), "block-diagonal mask")  # the path the resolve phase applied
    packing_reason = f"batching.method={b.method}" if b.method != "packed" else f"packed rows, {attention}"
    if external:  # whether this model's packed rows are exact, and how (train/models/packed.py)
        can = "can run packed rows" if getattr(model, "supports_packing", False) else \
            "cannot run packed rows (supports_packing is false): refused if asked"
        packing_reason += f"; this model {can}: {getattr(model, 'packing_reason', 'not checked')}"
    comp = compiled.report() if compiled is not None else {}
    return {
        "precision": _lever(policy.mode != "fp32", f"{policy.mode} [{policy.source}] {policy.reason}; {where}"),
        "buckets": _lever(b.method in BUCKETED, f"batching.method={b.method}, pad_to={b.pad_to}"),
        "token_budget": _lever(b.max_tokens is not None and b.method in (*BUCKETED, "packed"),
                               f"batching.max_tokens={_yaml(b.max_tokens)} (used by the bucketed and packed methods; "
                               f"batching.method={b.method})"),
        "packing": _lever(b.method == "packed", packing_reason),
        "clipping": _lever(cfg.clip.method != "none", f"clip.method={cfg.clip.method} on the model's parameters"),
        "numerics_guard": _lever(True, "non-finite steps skipped and counted; culprit named from the model's "
                                       "module tree"),
        "compile": _lever(bool(comp.get("enabled")), str(comp.get("reason") or "no compile session")),
        "compile_warmup": _lever(bool(comp.get("enabled")) and comp.get("warmup_s") is not None,
                                 "per-shape warm-up of every planned batch shape" if comp.get("enabled")
                                 else "compile is off"),
        "profile_attribution": _lever(profiled, "python -m train profile (make profile) on this config"
                                      if not profiled else "torch.profiler attribution table in this run"),
        "ddp": _lever(ctx.enabled, f"{ctx.world_size} processes ({ctx.backend})" if ctx.enabled
                      else "a single process (NPROC=1)"),
        "exact_resume": _lever(True, "weights_only checkpoints (state_dicts, RNG per rank, sampler position)"
                               + ("; the Hugging Face config as JSON in spec.hf_config" if external
                                  and cfg.model.source.startswith("hf:") else "")),
        "bench": _bench_lever(cfg, bench_rows),
        "checkpoint_blocks": getattr(model, "checkpoint_blocks_info", None) or _lever(False, OFF_REASON),
        "mfu": _lever(True, "FLOPs counted on the built-in encoder (its spec)" if not external
                      else "FLOPs counted on this model (FlopCounterMode, perf.flops_method)"),
    }
