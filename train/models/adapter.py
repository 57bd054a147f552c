"""Low-rank adapters (``model.adapter``) through peft: LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large
Language Models") injected into a transformers model with ``peft.get_peft_model``, nothing re-implemented.

``model.adapter: {type: lora, r: 16, alpha: 32, dropout: 0.0, targets: auto}`` — ``targets: auto`` is the family's
attention and MLP projections (:data:`FAMILY_TARGETS`), or a list of module names (the last component of a module
path, as peft's ``target_modules`` takes them). Only the adapter's matrices train (and a classifier's head, kept
whole through peft's ``modules_to_save``); the optimizer sees only those (``param_groups`` skips frozen
parameters), and a checkpoint holds only them plus :func:`base_fingerprint`, the frozen base's content hash, which a
resume compares before it loads anything.

peft is imported only here and only when an adapter is asked for: runs without one never import it.
"""

from __future__ import annotations

import hashlib
import warnings
from typing import Any, Optional

import torch
from torch import nn

from train.compat import autocast_enabled, full_tensor, is_dtensor
from train.config.adapter import AdapterSettings
from train.errors import UserError

_DECODER = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_BERT = ("query", "key", "value", "dense")
FAMILY_TARGETS: dict[str, tuple[str, ...]] = {
    "llama": _DECODER, "qwen2": _DECODER, "qwen3": _DECODER, "mistral": _DECODER, "gemma": _DECODER,
    "gemma2": _DECODER, "phi3": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
    "gpt2": ("c_attn", "c_proj", "c_fc"),
    "bert": _BERT, "roberta": _BERT, "xlm-roberta": _BERT, "electra": _BERT,
    "distilbert": ("q_lin", "k_lin", "v_lin", "out_lin", "lin1", "lin2"),
}
"""``targets: auto`` per ``model_type``: every attention and MLP projection of a block (BERT's ``dense`` also names
its pooler's and output layers' projections). GPT-2's are ``Conv1D`` (weights stored transposed: peft's
``fan_in_fan_out``)."""
CONV1D_FAMILIES = ("gpt2",)
CLASSIFIER_HEADS = ("classifier", "score", "pre_classifier")
"""A sequence classifier's head modules: newly initialised for the task, so they train whole beside the adapter."""
PEFT_SEQ_CLS_HEADS = ("classifier", "score")
"""The heads peft's ``task_type="SEQ_CLS"`` trains whole by itself (``PeftModelForSequenceClassification``)."""


def _module_names(model: nn.Module) -> list[str]:
    """The last components of ``model``'s Linear / Conv1D module paths, sorted (what ``targets`` may name)."""
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules()
             if n and (isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D")}
    return sorted(names)


def resolve_targets(settings: AdapterSettings, model: nn.Module, model_type: str, source: str) -> tuple[str, ...]:
    """The module names the adapter wraps: the family's (``auto``) or the listed ones, each checked against the model.

    Raises:
        UserError: ``auto`` on a family without a known list, or names the model lacks (listing the ones it has).
    """
    if settings.targets == "auto":
        if model_type not in FAMILY_TARGETS:
            raise UserError(f"model.adapter.targets=auto: no known projections for model_type {model_type!r} "
                            f"({source}); auto knows {', '.join(sorted(FAMILY_TARGETS))}: list the module names "
                            f"instead, from {', '.join(_module_names(model))}")
        wanted = FAMILY_TARGETS[model_type]
        have = set(_module_names(model))
        return tuple(n for n in wanted if n in have)
    have = _module_names(model)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    heads = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if head is not None and m is head}
    if heads & set(settings.targets):
        raise UserError(f"model.adapter.targets: {', '.join(sorted(heads & set(settings.targets)))} is the model's "
                        f"output layer (the LM head of {source}), which this project does not adapt (the chunked "
                        "loss runs through it; often tied to the embeddings): drop it from targets")
    missing = [n for n in settings.targets if n not in have]
    if missing:
        raise UserError(f"model.adapter.targets: {', '.join(missing)} not in the model ({source}, {model_type}); "
                        f"its Linear modules: {', '.join(have)}")
    return tuple(settings.targets)


ADAPTER_BYTES_PER_PARAMETER = 16
"""What training holds per adapter parameter: fp32 weight, gradient and AdamW's two moments (4 bytes each)."""


def check_adapter_size(settings: AdapterSettings, model: nn.Module, targets: tuple[str, ...], source: str,
                       available: Optional[int]) -> int:
    """Before peft builds anything: every targeted matrix (a 2-D weight of a module named in ``targets``) must have
    ``min(in, out) ≥ r`` — a rank above it adds nothing —, and the adapter's weights, gradients and AdamW state
    (:data:`ADAPTER_BYTES_PER_PARAMETER` per parameter, ``r · (in + out)`` parameters a matrix) must fit in
    ``available`` bytes (None: not measurable here, not checked). Returns the adapter's parameter count.

    Raises:
        UserError: ``r`` above a target's ``min(in, out)`` (naming it and the largest useful rank), or the estimate
            above the memory there is."""
    shapes = [(n, tuple(m.weight.shape)) for n, m in model.named_modules()
              if n.rsplit(".", 1)[-1] in targets and getattr(getattr(m, "weight", None), "ndim", 0) == 2]
    if not shapes:
        return 0
    name, shape = min(shapes, key=lambda x: min(x[1]))
    if settings.r > min(shape):
        raise UserError(f"model.adapter.r={settings.r}: above min(in, out) = {min(shape)} of {name} {list(shape)} "
                        f"({source}); a rank above it adds nothing: set model.adapter.r ≤ {min(shape)}")
    params = sum(settings.r * (a + b) for _, (a, b) in shapes)
    need = params * ADAPTER_BYTES_PER_PARAMETER
    if available is not None and need > available:
        raise UserError(f"model.adapter.r={settings.r}: the adapter's {params / 1e6:.1f}M parameters need about "
                        f"{need / 2**30:.1f} GiB for weights, gradients and AdamW state, and "
                        f"{available / 2**30:.1f} GiB is available here: lower model.adapter.r or "
                        "model.adapter.targets")
    return params


def available_memory(device: torch.device) -> Optional[int]:
    """Bytes that can still be allocated where training runs: free CUDA memory, or the host's ``MemAvailable``
    (Linux ``/proc/meminfo``); None where neither can be read."""
    if device.type == "cuda":
        try:
            return int(torch.cuda.mem_get_info(device)[0])
        except (RuntimeError, AssertionError):
            return None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        return kib * 1024
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def import_peft():
    """The ``peft`` module; UserError when it is not installed."""
    try:
        import peft
    except ImportError:
        raise UserError("model.adapter: the peft package is not installed (pip install -r requirements.txt)") from None
    return peft


def lora_config(settings: AdapterSettings, targets: tuple[str, ...], model_type: str, heads: tuple[str, ...],
                base_path: Optional[str] = None):
    """peft's ``LoraConfig`` for ``settings`` on ``targets``; ``heads``: modules trained whole (``modules_to_save``)."""
    peft = import_peft()
    # SEQ_CLS: peft adds "classifier" and "score" to modules_to_save itself; listing them too wrote them twice into
    # adapter_config.json
    own = [h for h in heads if h not in PEFT_SEQ_CLS_HEADS]
    return peft.LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                           target_modules=list(targets), fan_in_fan_out=model_type in CONV1D_FAMILIES,
                           modules_to_save=own or None, base_model_name_or_path=base_path,
                           task_type="CAUSAL_LM" if not heads else "SEQ_CLS")


def base_fingerprint(model: nn.Module) -> str:
    """A content hash (blake2b, 16 hex digits) of every parameter and buffer of ``model`` (a transformers model before
    the adapter is attached), by name: the base a checkpoint's adapter was trained on."""
    h = hashlib.blake2b(digest_size=8)
    for name, t in sorted(list(model.named_parameters()) + list(model.named_buffers()), key=lambda kv: kv[0]):
        data = t.detach().cpu().contiguous()
        h.update(f"{name}:{data.dtype}:{tuple(data.shape)}".encode())
        h.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return h.hexdigest()


def attach_adapter(wrapper: nn.Module, settings: AdapterSettings, model_type: str) -> dict[str, Any]:
    """Inject LoRA into ``wrapper.inner`` (a transformers model) in place with ``peft.get_peft_model``; the wrapper's
    forward, packed paths and chunked loss keep calling ``wrapper.inner``, now with the adapter's layers inside. The
    PeftModel is kept as ``wrapper.peft_model`` (not a submodule: the state dict is the wrapper's own). Returns the
    report's ``model.adapter`` block (type, r, alpha, dropout, targets, trainable parameters and share).

    Raises:
        UserError: see :func:`resolve_targets`.
    """
    inner = wrapper.inner
    source = wrapper.spec.source
    targets = resolve_targets(settings, inner, model_type, source)
    check_adapter_size(settings, inner, targets, source, available_memory(next(inner.parameters()).device))
    heads = tuple(h for h in CLASSIFIER_HEADS if isinstance(getattr(inner, h, None), nn.Module)) \
        if getattr(wrapper.spec, "task", "classification") != "causal-lm" else ()
    with warnings.catch_warnings():  # transformers' deprecation notices, raised inside peft
        warnings.simplefilter("ignore", FutureWarning)
        peft_model = import_peft().get_peft_model(inner, lora_config(settings, targets, model_type, heads))
    wrapper.__dict__["peft_model"] = peft_model  # not registered: the same parameters as wrapper.inner
    total = sum(p.numel() for p in wrapper.parameters())
    trainable = sum(p.numel() for p in wrapper.parameters() if p.requires_grad)
    wrapped = sorted({n for n, m in inner.named_modules() if hasattr(m, "lora_A")})
    return {"type": settings.type, "r": settings.r, "alpha": settings.alpha, "dropout": settings.dropout,
            "targets": list(targets), "heads_trained": list(heads), "modules_wrapped": len(wrapped),
            "trainable_parameters": trainable, "total_parameters": total,
            "trainable_share": round(trainable / total, 6) if total else None}


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable part of ``model``'s state dict (the adapter's matrices and any head trained whole); under FSDP2
    each gathered whole onto the CPU (a collective: every rank calls it), as a checkpoint must hold it."""
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    return {k: full_tensor(v).cpu() if is_dtensor(v) else v for k, v in model.state_dict().items() if k in names}


def load_adapter_state(model: nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
    """Load a checkpoint's adapter state (:func:`adapter_state`) into ``model``, whose base is already in place.

    Raises:
        UserError: the checkpoint's trainable tensors do not match the model's (another adapter layout)."""
    want = set(adapter_state(model))
    if set(state) != want:
        extra, missing = sorted(set(state) - want), sorted(want - set(state))
        raise UserError(f"{where}: its adapter does not fit this model ({len(missing)} tensors missing, e.g. "
                        f"{missing[:1]}; {len(extra)} unexpected, e.g. {extra[:1]}); resume with the run's own config")
    model.load_state_dict(state, strict=False)


def skips_directory_weights(cfg, hf_config: Optional[str]) -> bool:
    """Whether the builder skips the model directory's weights: on a resume (``hf_config`` given) of full
    fine-tuning, whose checkpoint holds every weight; never for an adapter run, whose checkpoint holds the adapter
    alone, so the base is built as the run built it. A pure question: nothing is seeded or read."""
    return cfg.model.adapter is None and hf_config is not None


def seed_adapter_base(cfg) -> None:
    """Before an adapter run's base is built: seed torch with ``train.seed``, so that a base from a random init
    (``hf:<model_type>``) is the same tensors in every process and on every resume (:func:`base_fingerprint` checks).
    Nothing for full fine-tuning, whose checkpoint holds every weight."""
    if cfg.model.adapter is not None:
        torch.manual_seed(cfg.train.seed)


def attach_configured_adapter(cfg, wrapper: nn.Module) -> None:
    """``cfg.model.adapter`` on ``wrapper`` (an external classifier or causal LM) where one is set: the adapter
    attached (:func:`attach_adapter`), ``wrapper.adapter_info`` the report's block, and the spec's ``adapter`` and
    ``base_fingerprint`` filled for the checkpoint; nothing without one (``adapter_info`` None).

    Raises:
        UserError: see :func:`resolve_targets`; peft not installed."""
    from train.config.adapter import parse_adapter

    settings = parse_adapter(cfg.model.adapter)
    wrapper.adapter_info = None
    if settings is None:
        return
    model_type = str(getattr(wrapper.inner.config, "model_type", ""))
    fingerprint = base_fingerprint(wrapper.inner)
    wrapper.adapter_info = attach_adapter(wrapper, settings, model_type)
    wrapper.spec.adapter = settings.as_json()
    wrapper.spec.base_fingerprint = fingerprint


def has_adapter(model: nn.Module) -> bool:
    return getattr(model, "peft_model", None) is not None


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint keeps of ``model``: its whole state dict, or for an adapter run the adapter alone (the
    frozen base is rebuilt from its source; the spec's ``base_fingerprint`` says which base it was). An FSDP2-sharded
    model's is gathered whole onto the CPU (a collective: every rank calls it)."""
    from train.parallel.fsdp import full_model_state

    return adapter_state(model) if has_adapter(model) else full_model_state(model)


def load_model_state(model: nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
    """Load a checkpoint's :func:`model_state` into ``model`` (built by the same config).

    Raises:
        UserError: an adapter checkpoint whose tensors do not fit this model's adapter."""
    if has_adapter(model):
        load_adapter_state(model, state, where)
    else:
        model.load_state_dict(state)


def hold_frozen_base(model: nn.Module, dtype: torch.dtype) -> int:
    """An adapter run in bf16 / fp16: the frozen weights the adapter wraps (each LoRA layer's ``base_layer``) held in
    ``dtype``, the precision policy's compute dtype — half the memory, and no fp32 → ``dtype`` copy of them that
    autocast would make at every forward and keep for the backward (its cast cache holds only weights that require
    a gradient). The matmuls see the same ``dtype`` values either way (autocast rounds fp32 weights to ``dtype``), so
    the numerics are unchanged; embeddings and norms stay fp32 (the policy's rule). A forward outside autocast (the
    fp32 probes of the resolve phase, FLOP counting) still runs: each cast layer's input goes in as ``dtype`` and its
    output comes back in the input's dtype (:func:`_input_to_weight`). Nothing for full fine-tuning or fp32.
    Returns the number of tensors cast. Export upcasts a copy to fp32 (train/models/export.py)."""
    if not has_adapter(model) or dtype == torch.float32:
        return 0
    cast = 0
    for module in model.modules():
        base = getattr(module, "base_layer", None)
        if not hasattr(module, "lora_A") or not isinstance(base, nn.Module):
            continue
        held = False
        for p in base.parameters(recurse=False):
            if not p.requires_grad and p.dtype != dtype:
                p.data = p.data.to(dtype)
                cast, held = cast + 1, True
        if held and not getattr(base, "held_in", None):
            base.held_in = dtype
            base.register_forward_pre_hook(_input_to_weight)
            base.register_forward_hook(_output_to_input)
    return cast


def _input_to_weight(module: nn.Module, args: tuple) -> Optional[tuple]:
    """Outside autocast, a held layer's input cast to its weights' dtype (the output is cast back after)."""
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or x.dtype == module.held_in or autocast_enabled(x.device.type):
        return None
    module.__dict__["out_dtype"] = x.dtype
    return (x.to(module.held_in), *args[1:])


def _output_to_input(module: nn.Module, args: tuple, out: Any) -> Any:
    dtype = module.__dict__.pop("out_dtype", None)
    return out if dtype is None or not isinstance(out, torch.Tensor) else out.to(dtype)
