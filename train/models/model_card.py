"""The model card (``README.md``) of an exported model: what it was fine-tuned from, on what, for how long, how much
better it got (held-out loss before and after, at the same evaluation samples), how fast it trained, and the command
that reproduces it. Written from the run's report.json (the keys of train/report/build.py); a figure the report does
not hold is written as "n/a", never invented. The YAML header follows the Hugging Face hub's model-card metadata
(``base_model``, ``library_name``, ``tags``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional


def installed_meta(source: str) -> dict:
    """The ``deep-model-perf.json`` of a model installed by ``make models`` (title, note, wheel), else {}."""
    from train.models.pretrained import MARKER

    if not source.startswith("hf:"):
        return {}
    try:
        return json.loads((Path(source[3:]).expanduser() / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def base_title(source: str, meta: dict) -> str:
    """What ``source`` was fine-tuned from: an installed model by its hub name, else the source as given."""
    return str(meta.get("title") or (source[3:] if source.startswith("hf:") else source))


def _num(value: Any, fmt: str = ".4f") -> str:
    return "n/a" if value is None else format(value, fmt)


def card_text(source: str, fmt: str, dtype: str, report: Optional[dict]) -> str:
    """The card's Markdown for a model exported as ``fmt`` (``transformers``, ``peft-adapter``, ``merged``) in
    ``dtype``, fine-tuned from ``source``, by the run whose report.json is ``report`` (None: the card says so)."""
    meta = installed_meta(source)
    base = base_title(source, meta)
    library = "peft" if fmt == "peft-adapter" else "transformers"
    head = ["---", f"base_model: {base}", f"library_name: {library}", "tags:", "- deep-model-perf", "---", ""]
    if not report:
        return "\n".join([*head, f"# Fine-tuned {base}", "", "The run's report.json was not found: no figures.", ""])
    q, perf, data, env = (report.get(k) or {} for k in ("quality", "perf", "data", "env"))
    causal = report.get("task") == "causal-lm"
    measure = "loss per target token" if causal else "loss per sample"
    after = q.get("eval_loss")
    rows = [
        ("base model", f"`{base}` (model.source `{source}`{'; ' + meta['note'] if meta.get('note') else ''})"),
        ("format", f"{fmt}, {dtype} weights"),
        ("data", f"{data.get('source', 'n/a')}: {data.get('train_samples', 'n/a')} training samples"),
        ("trained", f"{perf.get('steps', 'n/a')} optimizer steps, {perf.get('train_samples_seen', 'n/a')} samples"),
        (f"held-out {measure}, before → after",
         f"{_num(q.get('eval_loss_before'))} → {_num(after)} ({q.get('eval_samples', 'n/a')} validation samples)"),
        ("test", f"loss {_num(q.get('test_loss'))}" if causal else f"accuracy {_num(q.get('test_accuracy'))}"),
        ("throughput", f"{_num(perf.get('throughput_tokens_per_s'), '.1f')} tokens/s on "
                       f"{env.get('device_name') or env.get('device', 'n/a')} ({env.get('precision', 'n/a')})"),
    ]
    run_dir = report.get("run_dir") or "runs/<id>"
    lines = [*head, f"# {base}, fine-tuned ({report.get('run_id', '')})", "",
             f"Fine-tuned from {base} with deep-model-perf; every figure is from the run's report.json.", "",
             "| | |", "| --- | --- |", *(f"| {k} | {v} |" for k, v in rows), "",
             "Reproduce:", "", "```sh", f"python -m train train --config {run_dir}/config.yaml", "```", ""]
    return "\n".join(lines)
