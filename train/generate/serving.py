"""The serving paths of a decoder, chosen and warmed: which paths run here (:func:`available_paths`), a closed loop
of single requests (:func:`serve_single`), ``generate.path=auto``'s interleaved choice (:func:`choose_path`, cached
by :func:`auto_path`) and the warm-up + single + batched runs every measurement starts with
(:func:`warm_single_batched`). ``bench-generate`` (train/bench/generate.py) and ``make bench``'s decoder rows
(train/bench/decoder_inference.py) both use them."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Optional

import torch

from train.generate.engines import continuous, serve
from train.generate.figures import RequestTiming, summarize


def available_paths(model) -> dict[str, Optional[str]]:
    """Every path → None where it runs here, else why not (one line)."""
    import transformers as tf

    from train.compat import dynamo_supported

    out: dict[str, Optional[str]] = {"dynamic": None}
    ok, why = dynamo_supported()
    out["static-compile"] = None if ok else f"torch.compile is not available here ({why}); run generate.path=dynamic"
    has_cb = hasattr(model, "init_continuous_batching") and hasattr(tf, "ContinuousBatchingConfig")
    out["continuous"] = None if has_cb else (f"transformers {tf.__version__} has no continuous batching for this "
                                             "model (init_continuous_batching); run generate.path=dynamic")
    return out


def serve_single(model, path: str, prompts: list[list[int]], gen) -> list[RequestTiming]:
    """One request at a time, each sent when the previous one is answered (closed loop, batch 1); continuous
    batching keeps one manager running across them."""
    if path == "continuous":
        return continuous(model, prompts, gen, closed_loop=True)
    return [serve(model, path, [p], gen, 1)[0] for p in prompts]


def choose_path(model, paths: list[str], prompts, gen, batch_size: int, rounds: int) -> tuple[str, dict[str, Any]]:
    """``generate.path=auto``: each path's batched run, interleaved over ``rounds`` (the A/B primitive, each run
    self-timed over its span), paired ratios of output tokens/s against ``dynamic``; the fastest median kept."""
    from train.perf.ab import Arm, interleave

    def arm(path: str) -> Arm:
        def one() -> dict[str, float]:
            fig = summarize(serve(model, path, prompts, gen, batch_size))
            return {"output_tokens": fig["output_tokens"], "seconds": fig["span_s"]}
        return Arm(path, one)

    ab = interleave([arm(p) for p in paths], rounds=rounds, window=1, warmup=1, device=torch.device("cpu"))
    rate = {p: ab.arms[p].median("output_tokens") for p in paths}
    best = max(paths, key=lambda p: rate[p] or 0.0)
    ratios = {p: ab.ratio(p, "dynamic", "output_tokens").as_dict() for p in paths if p != "dynamic"}
    why = (f"auto: {best} served the most output tokens/s batched ({', '.join(f'{p} {rate[p]:.1f}' for p in paths)}"
           f"; median of {rounds} interleaved rounds)")
    return best, {"output_tokens_per_s": rate, "vs_dynamic": ratios, "reason": why}


def auto_path(cfg, model, paths: list[str], prompts: list[list[int]], gen, device: torch.device,
              measure: Callable[..., tuple[str, dict[str, Any]]] = choose_path) -> tuple[str, dict[str, Any]]:
    """``generate.path=auto``: :func:`choose_path`'s answer, cached like the other measured decisions
    (train/tools/decisions.py) for this machine, model, precision, paths and workload; a busy machine's is used but
    not cached."""
    import hashlib

    from train.tools.decisions import cache_path, machine_identity, read_cached, store
    from train.tools.env import machine_load

    g = cfg.generate
    fingerprint = {**machine_identity(device), "paths": paths, "batch_size": g.batch_size,
                   "max_new_tokens": g.max_new_tokens, "ignore_eos": g.ignore_eos,
                   "model": [type(model).__name__, sum(p.numel() for p in model.parameters()),
                             str(next(model.parameters()).dtype)],
                   "prompts": hashlib.sha256(repr(prompts).encode()).hexdigest()[:16]}
    path = cache_path(cfg.data.cache_dir, "generate-path", fingerprint, 1)
    cached = read_cached(path, fingerprint, "path", tuple(paths))
    if cached is not None:
        return cached["path"], {**cached["measurement"], "reason": cached["reason"]}
    load = machine_load()
    best, choice = measure(model, paths, prompts, gen, g.batch_size, cfg.bench.rounds)
    store(path, {"fingerprint": fingerprint, "path": best, "reason": choice["reason"], "measurement": choice}, load)
    return best, choice


def warm_single_batched(cfg, model, paths: list[str], prompts: list[list[int]], gen, notice: Callable[[str], None],
                        single_threads: Optional[int] = None) -> tuple[dict[str, Any], dict, dict]:
    """Every path warmed up (``static-compile`` compiles each prompt bucket and batch size it will serve, in the
    shared compile cache), then served single (closed loop) and batched (``generate.batch_size``): ``(warm-up
    seconds per path, single timings per path, batched timings per path)``. A path other than ``dynamic`` that
    raises is left out of the timings, its warm-up entry ``{"warmup_s": None, "error": why}`` (one notice line): one
    failed path never ends the measurement of the others. ``single_threads``: the torch threads of the single runs
    (train/generate/decode_choices.py), every thread for the rest."""
    if "static-compile" in paths:  # compiled kernels go to (and come from) the shared compile cache
        from train.compiling.session import setup_cache_dir

        setup_cache_dir(cfg.compile.cache_dir)
    batch_size = cfg.generate.batch_size
    warm: dict[str, Any] = {}
    single: dict[str, list] = {}
    batched: dict[str, list] = {}
    for path in paths:
        t = time.perf_counter()
        try:
            serve(model, path, prompts, gen, batch_size)
            serve_single(model, path, prompts, gen)
        except Exception as exc:  # noqa: BLE001  (any failure of a path's engine: that path's figures are null)
            if path == "dynamic":  # the reference every comparison needs
                raise
            warm[path] = {"warmup_s": None, "error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"}
            notice(f"{path} failed while warming up, left out: {warm[path]['error']}")
            continue
        warm[path] = {"warmup_s": time.perf_counter() - t}
        notice(f"{path} warmed up in {warm[path]['warmup_s']:.1f} s")
    every = torch.get_num_threads()
    torch.set_num_threads(single_threads or every)
    try:
        for p in (p for p in paths if warm[p]["warmup_s"] is not None):
            single[p] = serve_single(model, p, prompts, gen)
    finally:
        torch.set_num_threads(every)
    for p in single:
        batched[p] = serve(model, p, prompts, gen, batch_size)
    return warm, single, batched
