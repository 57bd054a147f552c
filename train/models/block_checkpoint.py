"""``memory.checkpoint_blocks``: activation checkpointing per transformer block (Chen et al. 2016, "Training Deep
Nets with Sublinear Memory Cost"), through the libraries, never re-implemented.

A checkpointed block keeps only its inputs for the backward pass; its forward runs again in the backward to rebuild
the intermediates it dropped (``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: the RNG state is
restored, so dropout masks repeat, and autocast is re-entered as it was). The step costs one extra forward per block.

* Hugging Face models whose class ``supports_gradient_checkpointing``: transformers' own switch on every decoder /
  encoder layer (``activation_checkpointing_enable`` in 5.x, ``gradient_checkpointing_enable`` in 4.x), non-reentrant,
  with :class:`~train.models.varlen.ReplayAttention` re-entering the packed rows' attention path (varlen plan,
  eager-mask implementation) for the recomputation. Non-reentrant needs no ``enable_input_require_grads`` for LoRA.
* Everything else (the built-in encoder, ``python:`` models, Hugging Face models without the switch): each block
  :func:`train.parallel.fsdp.transformer_blocks` finds gets a forward that checkpoints its class's forward while
  training with gradients on. The module tree and the state dict are unchanged (checkpoints, FSDP2 units, export).

Under ``dist.strategy=fsdp`` it is applied before ``fully_shard`` (torchtitan's order): FSDP2's hooks stay outside
the checkpointed forward and gather the block's weights before its recomputation.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from train.errors import UserError
from train.parallel.fsdp import transformer_blocks

OFF_REASON = ("memory.checkpoint_blocks=false: every block's activations kept for the backward, no recomputation "
              "(set it true where memory, not speed, limits the run)")


def _checkpointed_forward(block: nn.Module, *args: Any, **kwargs: Any) -> Any:
    # the class's forward (FSDP2's subclass inherits it): the instance attribute that routes here is not it
    forward = type(block).forward.__get__(block)
    if block.training and torch.is_grad_enabled():
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return forward(*args, **kwargs)


def _hf_switch(model: nn.Module) -> Any:
    """The transformers model whose layers transformers itself checkpoints, or None."""
    inner = getattr(model, "inner", None)
    if getattr(model, "kind", None) == "hf" and getattr(inner, "supports_gradient_checkpointing", False):
        return inner
    return None


def _hf_set(inner: Any, on: bool) -> None:
    from train.models.varlen import ReplayAttention

    # transformers 5.x renamed the switch (the old name warns); 4.x has only the old one
    if not on:
        off = getattr(inner, "activation_checkpointing_disable", None) or inner.gradient_checkpointing_disable
        off()
        return
    kwargs = {"use_reentrant": False, "context_fn": ReplayAttention(inner.config)}
    enable = getattr(inner, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def set_checkpoint_blocks(model: nn.Module, on: bool, source: str = "") -> dict[str, Any]:
    """Checkpoint every transformer block of ``model`` (``on``) or none (module docstring); idempotent. Returns the
    lever's report entry ``{"applied": bool, "reason": str, "blocks": int}``, also kept as
    ``model.checkpoint_blocks_info``. ``source``: ``model.source``, for the error.

    Raises:
        UserError: ``on`` and the model has no repeated blocks (an ``nn.ModuleList`` of one module class) to
            checkpoint.
    """
    info = getattr(model, "checkpoint_blocks_info", None)
    if info is not None and info["applied"] == bool(on):
        return info
    inner = _hf_switch(model)
    blocks = transformer_blocks(inner if inner is not None else model)
    if inner is not None:
        _hf_set(inner, on)
        how = f"transformers' gradient checkpointing on {type(inner).__name__}'s {len(blocks)} layers"
    elif on and not blocks:
        raise UserError(f"memory.checkpoint_blocks=true: model.source={source or 'this model'} has no repeated "
                        "transformer blocks (an nn.ModuleList of one module class) to checkpoint; set "
                        "memory.checkpoint_blocks=false")
    else:
        for block in blocks:
            if on:
                block.forward = functools.partial(_checkpointed_forward, block)  # a partial: deep copies follow
            else:
                block.__dict__.pop("forward", None)
        how = f"torch.utils.checkpoint around each of {len(blocks)} {type(blocks[0]).__name__ if blocks else ''}"
    info = {"applied": bool(on), "blocks": len(blocks) if on else 0,
            "reason": (f"memory.checkpoint_blocks=true: {how} (use_reentrant=False); each block keeps its input "
                       "and runs its forward again in the backward: less activation memory, about +30% step time")
            if on else OFF_REASON}
    model.checkpoint_blocks_info = info
    return info
