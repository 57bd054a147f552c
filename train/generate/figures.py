"""The latency figures of generation, with the definitions serving benchmarks use, from per-request timestamps.

Per request (``sent``: the request handed to the server, after any queueing the load generator imposed — the
figures include the server's own queueing; ``token_times``: when each output token came out):

* **TTFT** (time to first token): ``token_times[0] - sent``;
* **TPOT** (time per output token, vLLM's ``benchmarks/serve.py`` definition): ``(E2E - TTFT) / (output tokens - 1)``,
  one value per request (undefined for a one-token answer);
* **inter-token gaps** (vLLM's "ITL"; NVIDIA's GenAI-Perf calls TPOT "ITL"): every ``token_times[i+1] -
  token_times[i]``, pooled across requests;
* **E2E** (end-to-end latency): ``token_times[-1] - sent``.

p50 / p90 / p99 of each (``train.perf.timer.percentiles``); output tokens/s and requests/s over the run's span
(first send → last token); **goodput**: requests/s meeting every SLO at once (TTFT ≤ ``slo_ttft_ms`` and TPOT ≤
``slo_tpot_ms``; a one-token answer meets the TPOT SLO). Times are seconds (``time.perf_counter``) in, milliseconds
out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from train.perf.timer import percentiles

QUANTILES = (50, 90, 99)


@dataclass
class RequestTiming:
    """One request: ``sent`` (s), ``token_times`` (s, one per output token), its prompt and output tokens."""

    sent: float
    token_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)

    @property
    def output_tokens(self) -> int:
        return len(self.token_times)

    def ttft_ms(self) -> Optional[float]:
        return (self.token_times[0] - self.sent) * 1e3 if self.token_times else None

    def e2e_ms(self) -> Optional[float]:
        return (self.token_times[-1] - self.sent) * 1e3 if self.token_times else None

    def tpot_ms(self) -> Optional[float]:
        """``(E2E - TTFT) / (output tokens - 1)``; None for fewer than two output tokens."""
        n = self.output_tokens
        return (self.token_times[-1] - self.token_times[0]) * 1e3 / (n - 1) if n >= 2 else None

    def gaps_ms(self) -> list[float]:
        return [(b - a) * 1e3 for a, b in zip(self.token_times, self.token_times[1:])]


def summarize(requests: list[RequestTiming], slo_ttft_ms: Optional[float] = None,
              slo_tpot_ms: Optional[float] = None) -> dict[str, Any]:
    """The run's figures (module docstring): ``ttft_ms``, ``tpot_ms``, ``itl_ms`` (pooled gaps), ``e2e_ms`` as
    ``{p50, p90, p99}`` (None where no request has the figure), ``output_tokens_per_s``, ``requests_per_s``,
    ``goodput_requests_per_s`` (None without an SLO), ``span_s``, counts and the definitions' names.

    Raises:
        ValueError: no request, or a request with no output token (a server that answered nothing)."""
    if not requests:
        raise ValueError("no requests to summarize")
    if any(not r.token_times for r in requests):
        raise ValueError("a request produced no output token")
    start = min(r.sent for r in requests)
    span = max(r.token_times[-1] for r in requests) - start
    tokens = sum(r.output_tokens for r in requests)

    def pct(values: list[Optional[float]]) -> dict[str, Optional[float]]:
        kept = [v for v in values if v is not None]
        return percentiles(kept, QUANTILES) if kept else {f"p{q}": None for q in QUANTILES}

    tpot = [r.tpot_ms() for r in requests]
    out: dict[str, Any] = {
        "requests": len(requests), "output_tokens": tokens, "span_s": span,
        "ttft_ms": pct([r.ttft_ms() for r in requests]), "tpot_ms": pct(tpot),
        "itl_ms": pct([g for r in requests for g in r.gaps_ms()]), "e2e_ms": pct([r.e2e_ms() for r in requests]),
        "output_tokens_per_s": tokens / span if span > 0 else None,
        "requests_per_s": len(requests) / span if span > 0 else None,
        "mean_output_tokens": tokens / len(requests),
        "values_ms": {"ttft": [r.ttft_ms() for r in requests], "e2e": [r.e2e_ms() for r in requests]},
        "definitions": {"ttft": "first token out - request sent", "tpot": "(e2e - ttft) / (output tokens - 1), per "
                        "request (vLLM serve.py)", "itl": "gaps between consecutive tokens, pooled across requests "
                        "(vLLM's ITL; GenAI-Perf's ITL is TPOT)", "e2e": "last token out - request sent"}}
    one_token = sum(1 for t in tpot if t is None)
    out["one_token_requests"] = one_token  # TPOT is undefined for them: excluded from tpot_ms, counted here
    if one_token == len(requests):
        out["tpot_unavailable_reason"] = (f"every request ended at its first token ({one_token}: EOS first, or "
                                          "generate.max_new_tokens=1): TPOT = (E2E - TTFT) / (tokens - 1) is undefined")
    if slo_ttft_ms is None and slo_tpot_ms is None:
        out["goodput_requests_per_s"] = None
        out["goodput_unavailable_reason"] = "no SLO set (generate.slo_ttft_ms, generate.slo_tpot_ms)"
        return out
    good = sum(1 for r, t in zip(requests, tpot)
               if (slo_ttft_ms is None or r.ttft_ms() <= slo_ttft_ms)
               and (slo_tpot_ms is None or t is None or t <= slo_tpot_ms))
    out["goodput_requests_per_s"] = good / span if span > 0 else None
    out["requests_meeting_slo"] = good
    return out


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> np.ndarray:
    """``n`` arrival times (s from the start) of a Poisson process of ``rate`` requests/s, computed before the run
    (exponential gaps, seeded): a sender that waits for its own work before drawing the next gap would drift late
    under load and understate the offered rate.

    Raises:
        ValueError: ``rate`` not positive or ``n`` < 1."""
    if not rate > 0 or n < 1:
        raise ValueError(f"a Poisson schedule needs rate > 0 and n >= 1 (got rate={rate}, n={n})")
    return np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, n))
