"""Three fixed prompts answered by a causal LM before the first step and after the last (report.json
``quality.answers``): a judgement a user can make by reading, beside the held-out loss.

The prompts are the first :data:`N_PROMPTS` validation samples that have a prompt (a chat row: the rendered
conversation up to the assistant's turn; a prompt + completion row: its prompt), else the first
:data:`TEXT_PREFIX` tokens of the first validation texts: fixed by the data's split, the same before and after, and
for every run on the same data. Each is answered alone (batch 1, no padding), greedily, by transformers'
``generate`` on the run's model (its adapter included), for at most :data:`MAX_NEW_TOKENS` tokens, ending at the
run's EOS.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Optional

import torch

N_PROMPTS = 3
MAX_NEW_TOKENS = 32
TEXT_PREFIX = 8


def fixed_prompts(bundle: Any) -> list[tuple[list[int], list[int]]]:
    """``[(prompt ids, reference ids), …]``: :data:`N_PROMPTS` validation samples (module docstring)."""
    split = bundle.splits.get("validation")
    if split is None or not len(split):
        return []
    out: list[tuple[list[int], list[int]]] = []
    for ids, n_prompt in zip(split.ids, split.labels):
        if int(n_prompt) > 0:
            ids = [int(i) for i in ids]
            out.append((ids[:int(n_prompt)], ids[int(n_prompt):]))
        if len(out) == N_PROMPTS:
            return out
    return [([int(i) for i in ids[:TEXT_PREFIX]], [int(i) for i in ids[TEXT_PREFIX:]])
            for ids in list(split.ids)[:N_PROMPTS]]


def answer_prompts(model: torch.nn.Module, bundle: Any, device: torch.device, autocast: Any = None) -> dict:
    """``{"answers": [{"prompt", "reference", "answer"}, …]}`` (decoded text) of :func:`fixed_prompts`, or
    ``{"answers": None, "unavailable_reason": …}`` where they cannot be generated (not a transformers decoder,
    no tokenizer file, or ``generate`` failing on this model: the reason, never a traceback). ``autocast``: the
    run's autocast context factory (None: full precision)."""
    inner = getattr(model, "inner", None)
    path = (bundle.tokenizer_info or {}).get("path")
    if inner is None or not hasattr(inner, "generate") or not path:
        return {"answers": None, "unavailable_reason": "not a transformers decoder with a tokenizer file"}
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    eos = getattr(bundle, "eos_id", None)
    pad = getattr(bundle, "pad_id", None)
    was_training = inner.training
    inner.eval()
    answers: list[dict[str, Optional[str]]] = []
    try:
        with torch.no_grad(), (autocast() if autocast is not None else nullcontext()):
            for prompt, reference in fixed_prompts(bundle):
                ids = torch.tensor([prompt], device=device)
                out = inner.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=MAX_NEW_TOKENS, eos_token_id=eos, pad_token_id=pad)
                new = [int(i) for i in out[0, len(prompt):].tolist() if int(i) != eos]
                answers.append({"prompt": tok.decode(prompt, skip_special_tokens=False),
                                "reference": tok.decode(reference, skip_special_tokens=True),
                                "answer": tok.decode(new, skip_special_tokens=True)})
    except Exception as exc:  # noqa: BLE001 - a figure of the report, never the run's end
        return {"answers": None, "unavailable_reason": f"generate failed ({type(exc).__name__}: "
                                                         f"{str(exc).splitlines()[0][:160] if str(exc) else ''})"}
    finally:
        inner.train(was_training)
    return {"answers": answers}
