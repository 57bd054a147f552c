"""The first response of a fresh process — what a user sees after a deploy — on a cold and on a warm compile cache.

Two processes run ``bench-generate --child`` one after the other on the same serving path (``static-compile``) with
the same ``compile.cache_dir``: the first finds it empty (cold: dynamo traces, inductor compiles every kernel), the
second finds what the first wrote (warm: dynamo traces again — its in-memory graphs die with the process — but
inductor's FX-graph and AOTAutograd caches answer instead of compiling). Each process serves one request, the first
held-out prompt, and reports:

* ``time_to_first_response_s``: process start (before ``import torch``) → the request's last token: imports, model
  load, prompts, compilation, generation — a deploy's cold start;
* ``first_response_s``: the request alone (sent → last token), the model already loaded: what the first caller waits.

The target ratio is ``first_response_s`` warm / cold (issue: ≤ 0.25).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[2]
"""The repository root (holds the ``train`` package): the children's PYTHONPATH."""
FRESH_PATH = "static-compile"
"""The path whose first response depends on the compile cache (the others compile nothing)."""


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def child_command(run_dir: Optional[str], config: Optional[str], overrides: list[str], cache: Path,
                  out: Path) -> list[str]:
    """The ``python -m train bench-generate`` command line of one child (its path and cache forced)."""
    base = [o for o in overrides if not o.startswith(("generate.path=", "compile.cache_dir=", "train.run_id="))]
    return [sys.executable, "-m", "train", "bench-generate", *([run_dir] if run_dir else []),
            *(["--config", config] if config else []), *base, f"generate.path={FRESH_PATH}",
            f"compile.cache_dir={cache}", "train.progress=false", "--child", str(out)]


def run_child(cmd: list[str], out: Path) -> dict[str, Any]:
    """Run one child to its end; its JSON result, plus ``process_wall_s``.

    Raises:
        RuntimeError: the child failed (its stderr's tail in the message)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"bench-generate first-response child failed, exit {proc.returncode}:\n"
                           f"{proc.stderr[-3000:]}")
    return {**json.loads(out.read_text()), "process_wall_s": time.perf_counter() - t0}


def fresh_process_first_response(run_dir: Optional[str], config: Optional[str], overrides: list[str], out_dir: Path,
                                 unavailable: Optional[str] = None,
                                 runner: Callable[[list[str], Path], dict[str, Any]] = run_child) -> dict[str, Any]:
    """A cold-cache and then a warm-cache fresh process (module docstring), in ``out_dir/inductor-cache`` (emptied
    first: cold by construction). ``unavailable``: why ``static-compile`` cannot run here — the figures are then
    null with that reason. Returns the block ``generate.json`` keeps under ``first_response.fresh_process``."""
    if unavailable is not None:
        return {"cold": None, "warm": None, "warm_over_cold_first_response": None,
                "unavailable_reason": f"{FRESH_PATH} cannot run here: {unavailable}"}
    cache = (out_dir / "inductor-cache").resolve()
    shutil.rmtree(cache, ignore_errors=True)
    runs = {}
    for state in ("cold", "warm"):
        out = out_dir / f"first-response-{state}.json"
        runs[state] = runner(child_command(run_dir, config, overrides, cache, out), out)
    cold, warm = runs["cold"], runs["warm"]
    if (cold["cache_state"], warm["cache_state"]) != ("cold", "warm"):  # nothing compiled to reuse: no comparison
        why = (f"the compile cache was {cold['cache_state']}/{warm['cache_state']}, not cold/warm"
               + (": the first request ended at its first token, so no decode step was compiled"
                  if cold.get("output_tokens") == 1 else ""))
        return {"path": FRESH_PATH, "cold": cold, "warm": warm, "warm_over_cold_first_response": None,
                "unavailable_reason": why, "cache_dir": str(cache)}
    ratio = _ratio(warm["first_response_s"], cold["first_response_s"])
    return {"path": FRESH_PATH, "cold": cold, "warm": warm, "warm_over_cold_first_response": ratio,
            "warm_over_cold_time_to_first_response": _ratio(warm["time_to_first_response_s"],
                                                            cold["time_to_first_response_s"]),
            "target": {"warm_first_response_le_25pct_of_cold": {"value": ratio, "target": 0.25,
                                                                "reached": ratio is not None and ratio <= 0.25}},
            "cache_dir": str(cache),
            "definitions": "first_response_s: the first request alone (sent → last token), model loaded; "
                           "time_to_first_response_s: process start (before import torch) → that last token"}
