"""The serving paths of ``bench-generate``, each an existing engine driven as a server would be, every output token
timestamped (train/generate/figures.py turns the stamps into TTFT, TPOT, gaps and E2E):

* ``dynamic``: transformers' ``generate`` with its dynamic KV cache — what a user writes first;
* ``static-compile``: ``generate`` with the static cache (``cache_implementation="static"``) and ``torch.compile`` of
  the forward (transformers' own auto-compile, asked for on every device through its ``CompileConfig``); prompts are
  left-padded to a multiple of :data:`PROMPT_BUCKET` tokens, so one compiled graph serves each bucket;
* ``continuous``: transformers' continuous batching (``init_continuous_batching``: paged KV cache, requests join and
  leave the running batch at every step), fed request by request.

``generate``-based paths serve a batch at a time (a static-batching server: left-padded, every request of the batch
starts together); their per-token times come from a stopping criterion that stamps every decoding step. Greedy
decoding everywhere (``do_sample=False``), EOS ends a request unless ``ignore_eos``.
"""

from __future__ import annotations

import copy
import time
from typing import Any, Optional

import numpy as np
import torch

from train.generate.figures import RequestTiming

PATHS = ("dynamic", "static-compile", "continuous")
PROMPT_BUCKET = 16
NO_EOS = -1
"""The EOS id of ``ignore_eos``: no token has it."""
"""``static-compile`` pads prompts to a multiple of this many tokens: one compiled graph per bucket, not per length."""


def greedy_config(tf, max_new_tokens: int, eos_id: Optional[int], pad_id: int, ignore_eos: bool):
    """The ``GenerationConfig`` of every path: greedy, ``max_new_tokens``, EOS honoured unless ``ignore_eos``.

    ``ignore_eos`` sets the EOS id to -1, an id no model emits: an unset one would be filled in from the model's own
    ``generation_config`` (a trained run's export writes its EOS there) and end requests early."""
    return tf.GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                               eos_token_id=NO_EOS if ignore_eos else eos_id, pad_token_id=pad_id)


class _StepClock:
    """A stopping criterion that never stops: it stamps the end of every decoding step (a token for each row)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def left_pad(prompts: list[list[int]], pad_id: int, multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` LongTensor[B, L]: prompts right-aligned (generate's left padding), L the
    longest prompt rounded up to ``multiple``."""
    longest = max(len(p) for p in prompts)
    width = -(-longest // multiple) * multiple
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[r, width - len(p):] = 1
    return ids, mask


def _until_eos(row: list[int], eos_id: Optional[int]) -> list[int]:
    return row[:row.index(eos_id) + 1] if eos_id is not None and eos_id != NO_EOS and eos_id in row else row


def generate_batch(model, prompts: list[list[int]], path: str, gen, sent: Optional[list[float]] = None
                   ) -> list[RequestTiming]:
    """Serve ``prompts`` as one batch of ``generate`` on ``path`` (``dynamic`` or ``static-compile``); ``sent``: each
    request's send time (default: now, for all). A request's tokens end at its first EOS (``gen.eos_token_id``)."""
    import transformers as tf

    start = time.perf_counter()
    sent = sent or [start] * len(prompts)
    ids, mask = left_pad(prompts, gen.pad_token_id, PROMPT_BUCKET if path == "static-compile" else 1)
    clock = _StepClock()
    extra: dict[str, Any] = {}
    if path == "static-compile":
        compile_config = tf.CompileConfig(fullgraph=False, dynamic=False)
        compile_config._compile_all_devices = True  # transformers auto-compiles on CUDA only unless asked
        extra = {"cache_implementation": "static", "compile_config": compile_config}
    with torch.inference_mode():
        out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                             generation_config=gen, stopping_criteria=tf.StoppingCriteriaList([clock]), **extra)
    new = out[:, ids.shape[1]:].tolist()
    timings = []
    for r, p in enumerate(prompts):
        toks = _until_eos(new[r], gen.eos_token_id)
        timings.append(RequestTiming(sent[r], clock.times[:len(toks)], len(p), toks))
    return timings


def continuous_config(tf, prompts: list[list[int]], max_new_tokens: int, max_batch_tokens: int = 512):
    """A continuous-batching config sized for this workload (transformers sizes the paged cache from free GPU memory
    by default; on a CPU it would claim most of the machine's RAM and spend its first minute allocating it): pages of
    32 tokens, enough blocks for every request at its full length."""
    page = 32
    per_request = -(-(max(len(p) for p in prompts) + max_new_tokens) // page)
    return tf.ContinuousBatchingConfig(page_size=page, num_blocks=max(16, per_request * len(prompts) + 4),
                                       max_batch_tokens=max_batch_tokens)


def continuous(model, prompts: list[list[int]], gen, arrivals: Optional[np.ndarray] = None,
               timeout_s: float = 600.0, closed_loop: bool = False) -> list[RequestTiming]:
    """Serve ``prompts`` through transformers' continuous batching: all at once, request ``i`` sent at
    ``arrivals[i]`` seconds after the start (open loop; the schedule is computed before), or ``closed_loop``: each
    sent when the previous one is answered (single requests on one running manager). Each output token's time is
    the manager's own stamp (``record_timestamps``). Raises RuntimeError: a request unanswered within ``timeout_s``."""
    import transformers as tf

    manager = model.init_continuous_batching(  # a copy: the manager rewrites its config (an unset EOS becomes -1)
        generation_config=copy.deepcopy(gen),
        continuous_batching_config=continuous_config(tf, prompts, gen.max_new_tokens))
    manager.start()
    sent: dict[str, tuple[int, float]] = {}
    results: dict[int, RequestTiming] = {}
    try:
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            if arrivals is not None:
                time.sleep(max(0.0, t0 + float(arrivals[i]) - time.perf_counter()))
            rid = f"r{i}"
            sent[rid] = (i, time.perf_counter())
            manager.add_request(list(p), request_id=rid, max_new_tokens=gen.max_new_tokens, record_timestamps=True)
            if closed_loop:
                _collect(manager, prompts, gen, sent, results, i + 1, timeout_s)
        _collect(manager, prompts, gen, sent, results, len(prompts), timeout_s)
    finally:
        manager.stop(block=True)
    return [results[i] for i in range(len(prompts))]


def _collect(manager, prompts: list[list[int]], gen, sent: dict, results: dict, until: int, timeout_s: float) -> None:
    """Results from ``manager`` into ``results`` until it holds ``until`` of them.

    Raises:
        RuntimeError: a request got no answer within ``timeout_s``."""
    deadline = time.perf_counter() + timeout_s
    while len(results) < until:
        got = manager.get_result(timeout=max(0.1, deadline - time.perf_counter()))
        if got is None:
            if time.perf_counter() > deadline:
                raise RuntimeError(f"continuous batching: {until - len(results)} requests unanswered after "
                                   f"{timeout_s:.0f} s")
            continue
        i, when = sent[got.request_id]
        toks = _until_eos(list(got.generated_tokens), gen.eos_token_id)
        results[i] = RequestTiming(when, list(got.timestamps or [])[:len(toks)], len(prompts[i]), toks)


def static_batching_server(model, prompts: list[list[int]], path: str, gen, max_batch: int,
                           arrivals: Optional[np.ndarray] = None) -> list[RequestTiming]:
    """A static-batching server on ``generate``: requests queue (arriving at ``arrivals``, or all at once); whenever it
    is free, it serves up to ``max_batch`` waiting requests as one left-padded batch and takes the next batch only
    when that one is done. A request's times count from its arrival (queueing included)."""
    arrivals = np.zeros(len(prompts)) if arrivals is None else arrivals
    out: list[Optional[RequestTiming]] = [None] * len(prompts)
    t0, nxt = time.perf_counter(), 0
    queue: list[int] = []
    while nxt < len(prompts) or queue:
        now = time.perf_counter() - t0
        while nxt < len(prompts) and arrivals[nxt] <= now:
            queue.append(nxt)
            nxt += 1
        if not queue:
            time.sleep(max(0.0, float(arrivals[nxt]) - now))
            continue
        batch, queue = queue[:max_batch], queue[max_batch:]
        served = generate_batch(model, [prompts[i] for i in batch], path, gen,
                                [t0 + float(arrivals[i]) for i in batch])
        for i, timing in zip(batch, served):
            out[i] = timing
    return [t for t in out if t is not None]


def serve(model, path: str, prompts: list[list[int]], gen, batch_size: int,
          arrivals=None) -> list[RequestTiming]:
    """``prompts`` served on ``path``: continuous batching, or a static-batching server on ``generate``."""
    if path == "continuous":
        return continuous(model, prompts, gen, arrivals)
    return static_batching_server(model, prompts, path, gen, batch_size, arrivals)
