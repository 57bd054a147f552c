"""Sharded checkpoints of a ``dist.strategy=fsdp`` run: ``torch.distributed.checkpoint`` (DCP), each rank writing its
own shards, written atomically as a set.

A sharded checkpoint is a directory ``runs/<id>/checkpoints/step-00000120.dcp/``:

* ``.metadata`` and ``__<rank>_0.distcp`` (DCP's ``FileSystemWriter``): the model's and AdamW's tensors as each rank
  holds them (``get_state_dict``: parameter names, each a ``DTensor`` shard; optimizer state keyed by parameter
  name, so it loads into any layout);
* ``trainer.pt`` (rank 0, train/checkpoint.py's format): everything else a resume needs — progress, scheduler,
  every rank's RNG states, the spec and fingerprints (train/resume.py's ``full_state`` without ``model`` and
  ``optimizer``).

The set is written into ``.step-00000120.dcp.tmp/`` and renamed into place by rank 0 only after every rank's shards,
DCP's metadata (which rank 0 writes once all ranks have written) and ``trainer.pt`` are on disk: a rank killed
mid-write leaves the temporary directory (ignored, then pruned), never a checkpoint that looks complete, and the
previous checkpoint stays usable.

Loading: :func:`load_sharded` reads the shards into a sharded model and optimizer (a collective; DCP reshards when the
checkpoint was written by another number of ranks). :func:`load_whole` reads the whole state without a process group
(``dcp_to_torch_save``) in the format of a single-file checkpoint, for ``python -m train export``, ``bench-generate``
and a resume that does not shard (``ddp``, one process).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from train.checkpoint import load_checkpoint, save_checkpoint
from train.compat import fsdp2_api, load_state
from train.errors import UserError
from train.parallel.process_group import DistContext, agreed
from train.shutdown import pause_point

SUFFIX = ".dcp"
META = "trainer.pt"


def is_sharded_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a complete sharded checkpoint directory (its ``trainer.pt`` is written last)."""
    return path.is_dir() and (path / META).is_file() and (path / ".metadata").is_file()


def _dcp() -> Any:
    if fsdp2_api()[0] is None:  # the same torch release gate: DCP's FSDP2 state dicts come with it
        raise UserError(f"a sharded (dist.strategy=fsdp) checkpoint needs torch >= 2.6: {fsdp2_api()[1]}; "
                        "use the torch2x stack")
    import torch.distributed.checkpoint as dcp

    return dcp


def save_sharded(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, meta: Optional[dict[str, Any]],
                 ctx: DistContext) -> None:
    """Write ``model``'s and ``optimizer``'s shards (every rank its own) and ``meta`` (rank 0's; None elsewhere) as the
    checkpoint directory ``path``, atomically as a set. A collective: every rank calls it.

    Raises:
        UserError: on every rank, when any rank's write failed (disk full, permissions); ``path``'s previous
            content, if any, is intact.
    """
    dcp = _dcp()
    from torch.distributed.checkpoint.state_dict import get_state_dict

    tmp = path.with_name(f".{path.name}.tmp")

    def fresh() -> None:
        if ctx.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)

    agreed(fresh, ctx)  # also a barrier: no rank writes into the directory before it exists
    model_state, optimizer_state = get_state_dict(model, optimizer)
    try:
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(tmp),
                 process_group=ctx.control_group)
    except Exception as exc:  # DCP raises CheckpointException on every rank when any rank's write failed
        raise UserError(f"cannot write checkpoint {path} ({str(exc).splitlines()[0][:200]}); is the disk full? Free "
                        "space or set train.output_dir; earlier checkpoints are intact") from None

    def publish() -> None:
        if not ctx.is_main:
            return
        save_checkpoint(tmp / META, meta or {})
        pause_point(f"checkpoint set {path.name}")  # a test hook: kill -9 here leaves only the temporary directory
        old = path.with_name(f".{path.name}.old")
        if path.exists():  # a resumed run writes its step again
            path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old, ignore_errors=True)

    agreed(publish, ctx)


def read_meta(path: Path) -> dict[str, Any]:
    """``trainer.pt`` of the sharded checkpoint ``path``, with ``sharded`` set to ``str(path)``: the state a resume
    checks, without ``model`` and ``optimizer`` (:func:`load_sharded` or :func:`load_whole` reads those).

    Raises:
        UserError: an incomplete or corrupt checkpoint directory.
    """
    if not is_sharded_checkpoint(path):
        raise UserError(f"checkpoint {path} is not a complete sharded checkpoint (no .metadata or {META}); use an "
                        "earlier checkpoint")
    return {**load_checkpoint(path / META), "sharded": str(path)}


def load_sharded(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, ctx: DistContext) -> None:
    """Load the shards of ``path`` into the (FSDP2-sharded) ``model`` and its ``optimizer``: each rank reads the parts
    of every tensor its shards cover, whatever number of ranks wrote them (DCP's resharding). A collective.

    Raises:
        UserError: on every rank: the checkpoint's tensors do not fit this model (another shape or names).
    """
    dcp = _dcp()
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}

    def read() -> None:
        try:
            dcp.load(state, checkpoint_id=str(path), process_group=ctx.control_group)
        except Exception as exc:  # noqa: BLE001 - DCP wraps a missing key or shape mismatch on any rank alike
            raise UserError(f"checkpoint {path}: its shards do not fit this model ({str(exc).splitlines()[0][:200]})"
                            "; resume with the run's own config") from None

    agreed(read, ctx)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def load_whole(path: Path) -> dict[str, Any]:
    """The sharded checkpoint ``path`` as a single-file checkpoint's dict (train/resume.py): ``trainer.pt``'s state
    plus ``model`` (whole CPU tensors by name) and ``optimizer`` (an ``optimizer.state_dict()``: state keyed by
    parameter index in param-group order). No process group; reads every rank's shards.

    Raises:
        UserError: incomplete, corrupt, or this torch cannot read DCP's FSDP2 checkpoints.
    """
    state = read_meta(path)
    _dcp()
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        whole = Path(scratch) / "whole.pt"
        try:
            dcp_to_torch_save(str(path), str(whole))
        except Exception as exc:  # noqa: BLE001 - a truncated shard file shows as any of several errors
            raise UserError(f"checkpoint {path} is corrupt or truncated ({exc.__class__.__name__}); use an earlier "
                            "checkpoint") from None
        tensors = load_state(str(whole))
    state.pop("sharded")
    return {**state, "model": tensors["model"], "optimizer": indexed_optimizer_state(tensors["optimizer"])}


def indexed_optimizer_state(named: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict keyed by parameter name (``get_optimizer_state_dict``'s) → ``optimizer.state_dict()``'s
    format: parameters numbered in param-group order, state keyed by that number."""
    index: dict[str, int] = {}
    groups = []
    for group in named["param_groups"]:
        ids = [index.setdefault(name, len(index)) for name in group["params"]]
        groups.append({**group, "params": ids})
    state = {index[name]: dict(st) for name, st in named["state"].items() if name in index}
    return {"state": state, "param_groups": groups}


def load_any(path: Path) -> dict[str, Any]:
    """A checkpoint's whole state: a single-file checkpoint (train/checkpoint.py) or a sharded directory
    (:func:`load_whole`).

    Raises:
        UserError: as :func:`~train.checkpoint.load_checkpoint` or :func:`load_whole`.
    """
    return load_whole(Path(path)) if Path(path).is_dir() else load_checkpoint(path)
