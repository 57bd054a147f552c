"""What ``bench-generate`` serves: the decoder (a run directory's exported ``model/``, else its checkpoint; or
``model.source=hf:<dir>``) and the prompts (the held-out split of the run's own data)."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from train.errors import UserError


@dataclass
class Served:
    """The decoder ready to generate (fp32, eval mode), where it came from, and its special ids."""

    model: nn.Module
    source: str
    eos_id: Optional[int]
    pad_id: int
    context: Optional[int]


def _ids(config: Any, state: Optional[dict] = None) -> tuple[Optional[int], int]:
    special = (state or {}).get("special_tokens") or {}
    eos = special.get("eos_id", getattr(config, "eos_token_id", None))
    eos = eos[0] if isinstance(eos, list) and eos else eos
    pad = special.get("pad_id", getattr(config, "pad_token_id", None))
    return eos, int(pad if pad is not None else (eos if eos is not None else 0))


def _context(config: Any) -> Optional[int]:
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def load_served(run_dir: Optional[str], cfg) -> Served:
    """The decoder of ``run_dir`` (its ``model/`` when it is a plain model directory, else its final checkpoint, an
    adapter merged into its base) or of ``cfg.model.source`` (``hf:<dir>``).

    Raises:
        UserError: not a run directory, a classifier's run, a run without a checkpoint, a source that is not a local
            causal-LM directory."""
    from train.compat import hf_attn_implementation
    from train.models.library import import_transformers

    tf = import_transformers()
    attn = {"attn_implementation": hf_attn_implementation()}
    if run_dir is None:
        src = cfg.model.source
        d = Path(src[3:]).expanduser() if src.startswith("hf:") else None
        if d is None or not (d / "config.json").is_file() or cfg.model.task != "causal-lm":
            raise UserError(f"bench-generate: model.source={src} with model.task={cfg.model.task}: give a run "
                            "directory (python -m train bench-generate runs/<id>) or a causal-LM model directory "
                            "(model.task=causal-lm model.source=hf:<dir>), or run `make models` first: then it "
                            "serves SmolLM2-135M-Instruct")
        model = tf.AutoModelForCausalLM.from_pretrained(str(d), local_files_only=True, **attn)
        return Served(model.float().eval(), src, *_ids(model.config), _context(model.config))
    d = Path(run_dir)
    if not (d / "config.yaml").is_file():
        raise UserError(f"bench-generate: {d} is not a run directory (no config.yaml): give runs/<id> of a "
                        "model.task=causal-lm run")
    if cfg.model.task != "causal-lm":
        raise UserError(f"bench-generate: {d} is a {cfg.model.task} run; generation needs a decoder "
                        "(model.task=causal-lm, e.g. make train CONFIG=configs/causal-cpu.yaml)")
    plain = d / "model" / "config.json"
    ckpt = d / "checkpoint.pt"
    if plain.is_file() and not (d / "model" / "adapter_config.json").is_file():
        model = tf.AutoModelForCausalLM.from_pretrained(str(d / "model"), local_files_only=True, **attn)
        # the export wrote the run's EOS / pad ids into generation_config.json: no need to load the checkpoint
        return Served(model.float().eval(), str(d / "model"), *_ids(model.generation_config),
                      _context(model.config))
    if not ckpt.is_file():
        middle = sorted((p for p in (d / "checkpoints").glob("step-*") if p.suffix in (".pt", ".dcp")
                         and p.stem.split("-")[-1].isdigit()), key=lambda p: int(p.stem.split("-")[-1]))
        export = (f"; it has periodic checkpoints (newest {middle[-1]}): `python -m train export {d} --checkpoint "
                  f"{middle[-1]}` writes {d / 'model'}, which bench-generate then serves") if middle else ""
        raise UserError(f"bench-generate: {d} has no model/ and no checkpoint.pt: the run did not finish; let it "
                        f"finish or resume it (python -m train train --resume {d}){export}")
    return served_from_checkpoint(str(ckpt), "bench-generate")


def served_from_checkpoint(ckpt: str, who: str) -> Served:
    """The decoder of a ``checkpoint.pt`` (an adapter merged into a copy of its base), fp32, eval mode.

    Raises:
        UserError: not a decoder's checkpoint, or one that does not load (``who`` begins the message)."""
    from train.models.export import model_from_checkpoint
    from train.parallel.sharded_checkpoint import load_any

    state = load_any(ckpt)
    return served_from_wrapper(model_from_checkpoint(state, f"{who}: {ckpt}"), ckpt, state)


def served_from_wrapper(wrapper: nn.Module, source: str, state: Optional[dict] = None) -> Served:
    """A built decoder (train/models' ``ExternalCausalLM``) ready to generate: its transformers model, an adapter
    merged into a copy; the special ids from the checkpoint ``state`` where given, else the model's config."""
    peft_model = getattr(wrapper, "peft_model", None)
    inner = copy.deepcopy(peft_model).merge_and_unload() if peft_model is not None else wrapper.inner
    return Served(inner.float().eval(), f"{source}{' (adapter merged)' if peft_model is not None else ''}",
                  *_ids(inner.config, state), _context(inner.config))


def held_out_prompts(cfg, n: int, fraction: float, context: Optional[int], max_new_tokens: int,
                     truncate: Optional[str], bundle: Any = None) -> tuple[list[list[int]], dict[str, Any]]:
    """The first ``n`` samples of the run's test split (validation when empty) as prompts: a prompt + completion
    sample's prompt, a text sample's first ``fraction`` of its tokens (at least one; its EOS never), so the prompt
    lengths follow the data's. ``bundle``: the run's prepared data where the caller has it (else prepared here).
    Returns (prompts, facts: lengths, source split, truncations).

    Raises:
        UserError: fewer than two prompts; a prompt that leaves no room for ``max_new_tokens`` in ``context``
            unless ``truncate`` says which end to keep."""
    if bundle is None:
        from train.data import prepare_data

        bundle = prepare_data(cfg, None, notice=lambda *a, **k: None)
    split_name = "test" if len(bundle.splits["test"]) else "validation"
    split = bundle.splits[split_name]
    prompts, cut = [], 0
    for i in range(min(n, len(split))):
        ids = [int(t) for t in split.ids[i]]
        n_prompt = int(split.labels[i])
        body = ids[:-1] if ids and ids[-1] == bundle.eos_id else ids
        p = ids[:n_prompt] if n_prompt > 0 else body[:max(1, int(len(body) * fraction))]
        if context is not None and len(p) + max_new_tokens > context:
            room = context - max_new_tokens
            if truncate is None or room < 1:
                raise UserError(f"bench-generate: {split_name} sample {i} has a {len(p)}-token prompt; with "
                                f"generate.max_new_tokens={max_new_tokens} it exceeds the model's {context}-token "
                                "context: set generate.truncate_prompts=left (keep the end) or right, or lower "
                                "generate.max_new_tokens")
            p, cut = (p[-room:] if truncate == "left" else p[:room]), cut + 1
        prompts.append(p)
    empty_test = "" if split_name == "test" else " (the test split is empty)"
    if len(prompts) < 2:
        raise UserError(f"bench-generate: the {split_name} split has {len(prompts)} sample(s){empty_test}; at least 2 "
                        "prompts are needed: raise data.test_fraction (or data.val_fraction) and train again, or give "
                        "more data")
    lengths = [len(p) for p in prompts]
    short = (f"{len(prompts)} of the {n} prompts asked for (generate.requests): the {split_name} split has no more"
             f"{empty_test}") if len(prompts) < n else None
    return prompts, {"split": split_name, "requested": n, "prompts": len(prompts), "fewer_than_requested": short,
                     "prompt_tokens_mean": sum(lengths) / len(lengths),
                     "prompt_tokens_max": max(lengths), "truncated_prompts": cut,
                     "rule": "prompt + completion rows: the prompt; text rows: the first "
                             f"{fraction:g} of the sample's tokens"}


def place(served: Served, device: torch.device, precision: str) -> Served:
    """``served`` with its model on ``device`` in ``precision`` (``fp32``, ``bf16``, ``fp16``), in eval mode."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    served.model = served.model.to(device=device, dtype=dtype).eval()
    return served


def config_of_run(run_dir: str):
    """The resolved config a run wrote (``runs/<id>/config.yaml``).

    Raises:
        UserError: no such file, or one that does not load."""
    from train.config import load_config

    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise UserError(f"bench-generate: {run_dir} is not a run directory (no config.yaml)")
    return load_config(str(path), [])


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, default=lambda o: o.tolist() if isinstance(o, torch.Tensor) else str(o)) + "\n"
