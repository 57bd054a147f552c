"""Hugging Face ``TrainingArguments`` names as overrides: ``bf16=true`` → ``train.precision=bf16`` and so on.

An override without a section (``key=value``) is read as a Hugging Face flag name: :data:`HF_ALIASES` maps it to
this project's keys, and one ``notice:`` line says what it became. Anything else without a section is an error
naming the nearest alias.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from typing import Any, Optional

from train.errors import UserError


def _switch(key: str, on: Any, off: Any) -> Callable[[Any], list[tuple[str, Any]]]:
    def f(v: Any) -> list[tuple[str, Any]]:
        if not isinstance(v, bool):
            raise UserError(f"expected true or false, got {v!r}")
        return [(key, on if v else off)]
    return f


def _number(key: str, cast: type, extra: tuple = ()) -> Callable[[Any], list[tuple[str, Any]]]:
    def f(v: Any) -> list[tuple[str, Any]]:
        if isinstance(v, str):  # YAML 1.1 reads 5e-5 (no dot) as a string
            try:
                v = float(v)
            except ValueError:
                pass
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (cast is int and float(v) != int(v)):
            raise UserError(f"expected a{'n integer' if cast is int else ' number'}, got {v!r}")
        return [(key, cast(v)), *extra]
    return f


def _max_steps(v: Any) -> list[tuple[str, Any]]:
    if isinstance(v, bool) or not isinstance(v, int):
        raise UserError(f"expected an integer, got {v!r}")
    return [("train.max_steps", v if v > 0 else None)]  # HF: -1 = no limit (use the epochs)


def _grad_norm(v: Any) -> list[tuple[str, Any]]:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
        raise UserError(f"expected a number >= 0, got {v!r}")
    return [("clip.method", "none")] if v == 0 else [("clip.method", "global-norm"), ("clip.max_norm", float(v))]


def _report_to(v: Any) -> list[tuple[str, Any]]:
    v = "none" if v is None else str(v).lower()
    if v not in ("wandb", "none"):
        raise UserError(f"expected wandb or none (this project's other tracker is metrics.jsonl, always on), got {v!r}")
    return [("tracking.wandb", "on" if v == "wandb" else "off")]


PRECISION_FLAGS = ("bf16", "fp16")
"""HF flags that set ``train.precision``; expanded by :func:`_precision` (they depend on each other)."""


def _precision(flag: str, v: Any, current: Optional[Mapping[str, Any]], flags: dict[str, Any]) -> list[tuple[str, Any]]:
    """``bf16`` / ``fp16`` as ``train.precision`` pairs. ``true``: that dtype, refused when the other flag was given
    ``true`` earlier in the same overrides (the HF Trainer refuses both too). ``false`` only means "not this
    dtype": ``fp32`` when ``train.precision`` is that dtype in ``current`` (the raw config so far), else no change
    (an empty list), so ``bf16=true fp16=false`` stays bf16.

    Raises:
        UserError: not a boolean, or both flags true.
    """
    if not isinstance(v, bool):
        raise UserError(f"expected true or false, got {v!r}")
    other = next(f for f in PRECISION_FLAGS if f != flag)
    if v and flags.get(other) is True:
        raise UserError(f"{other}=true was given too; choose one of bf16=true or fp16=true (the Hugging Face "
                        "Trainer refuses both), or set train.precision")
    flags[flag] = v
    if v:
        return [("train.precision", flag)]
    train = (current or {}).get("train")
    was = train.get("precision") if isinstance(train, Mapping) else None
    return [("train.precision", "fp32")] if was == flag else []


HF_ALIASES: dict[str, Callable[[Any], list[tuple[str, Any]]]] = {
    "bf16": _switch("train.precision", "bf16", "fp32"),  # expanded by _precision; kept here for the names and docs
    "fp16": _switch("train.precision", "fp16", "fp32"),
    "group_by_length": _switch("batching.method", "optimal", "random"),
    "per_device_train_batch_size": _number("batching.batch_size", int, (("batching.max_tokens", None),)),
    "learning_rate": _number("optim.lr", float),
    "max_grad_norm": _grad_norm,
    "num_train_epochs": _number("train.epochs", float, (("train.max_steps", None),)),
    "max_steps": _max_steps,
    "report_to": _report_to,
    "torch_compile": _switch("compile.enabled", True, False),
}
"""HF flag → its values as this project's ``(section.key, value)`` pairs. ``group_by_length=true`` becomes the
length buckets (``batching.method=optimal``: less padding than HF's megabatches, which
``batching.method=hf-group-by-length`` reproduces); ``num_train_epochs`` clears ``train.max_steps`` (put
``max_steps`` after it to keep both, as HF lets ``max_steps`` win); ``max_grad_norm=0`` turns clipping off."""


def expand_hf_alias(key: str, value: Any, current: Optional[Mapping[str, Any]] = None,
                    flags: Optional[dict[str, Any]] = None) -> tuple[list[tuple[list[str], Any]], str]:
    """``(overrides as ([section, key], value), notice line)`` for an HF flag ``key=value``.

    ``current``: the raw config (``{section: {key: value}}``) the overrides so far built, and ``flags``: a dict
    shared by the calls for one list of overrides (this function records the precision flags in it). Both are
    read by ``bf16`` / ``fp16`` only (see :func:`_precision`); without ``current`` a ``false`` leaves
    ``train.precision`` unchanged, without ``flags`` ``bf16=true fp16=true`` is not detected.

    Raises:
        UserError: not a known HF flag (naming the nearest one), a value of the wrong kind, or both
            ``bf16=true`` and ``fp16=true``.
    """
    if key not in HF_ALIASES:
        close = difflib.get_close_matches(key, list(HF_ALIASES), n=1, cutoff=0.6)
        hint = f" Did you mean the Hugging Face flag {close[0]!r}?" if close else \
            f" Hugging Face flags understood: {', '.join(HF_ALIASES)}."
        raise UserError(f"override {key}={value!r}: the key must be section.key, e.g. train.max_steps.{hint}")
    try:
        pairs = _precision(key, value, current, {} if flags is None else flags) if key in PRECISION_FLAGS \
            else HF_ALIASES[key](value)
    except UserError as exc:
        raise UserError(f"override {key}={value!r} (a Hugging Face flag): {exc}") from None
    shown = " ".join(f"{k}={_yaml(v)}" for k, v in pairs) or \
        "train.precision unchanged (false only means not this dtype)"
    return [(k.split("."), v) for k, v in pairs], f"notice: Hugging Face flag {key}={_yaml(value)} → {shown}"


def _yaml(v: Any) -> str:
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)
