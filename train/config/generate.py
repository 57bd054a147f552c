"""The ``generate`` section of ``RunConfig``: what ``python -m train bench-generate`` serves and how it measures
(train/bench/generate.py). Read by that command only; its accepted values are declared on the fields."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from train.errors import Frozen, UserError, allowed, check_fields, comma_list

GENERATE_PATHS = ("auto", "dynamic", "static-compile", "continuous")


@dataclass
class GenerateConfig(Frozen):
    """Decoder inference: greedy decoding of prompts from the run's held-out split (train/generate/)."""

    path: str = allowed("auto", choices=GENERATE_PATHS)
    """The serving path of the open-loop runs and the headline: ``dynamic`` (``generate``, dynamic KV cache),
    ``static-compile`` (``generate`` with the static cache and ``torch.compile``), ``continuous`` (transformers'
    continuous batching), or ``auto``: every path is timed on single requests and batched, the fastest at
    saturation kept (the output says which and why)."""
    precision: str = allowed("auto", choices=("auto", "fp32", "bf16", "fp16"))
    """The served model's dtype (on ``train.device``): ``auto`` keeps a natively computed 16-bit dtype where it
    decodes measurably faster than fp32 with the held-out loss within 1 %, else fp32 (train/generate/
    decode_choices.py); greedy outputs are compared across paths in fp32 only."""
    max_new_tokens: int = allowed(32, ge=1)
    """New tokens per request (fewer where EOS comes first, unless ``ignore_eos``)."""
    ignore_eos: bool = False
    """Generate ``max_new_tokens`` whatever the model emits: fixed-length load (said in the output)."""
    requests: int = allowed(32, ge=2)
    """Prompts served per run (single, batched and each open-loop level), the first ones of the held-out split."""
    batch_size: int = allowed(8, ge=1)
    """Requests per ``generate`` call of the static-batching server (the batched closed loop and the baseline)."""
    load_levels: Union[str, float, list] = "0.25,0.5,0.9"
    """Open-loop offered rates as shares of the batched (closed-loop, maximum) rate; Poisson arrivals, seeded: a
    comma-separated string, one number, or a YAML list (``[0.25, 0.5]``)."""
    slo_ttft_ms: Optional[float] = allowed(None, gt=0)
    """Goodput's time-to-first-token SLO (ms); null: no goodput."""
    slo_tpot_ms: Optional[float] = allowed(None, gt=0)
    """Goodput's time-per-output-token SLO (ms)."""
    prompt_fraction: float = allowed(0.5, gt=0, lt=1)
    """A held-out sample's prompt: its first ``prompt_fraction`` of tokens (at least one; EOS never in it)."""
    fresh_process: bool = True
    """Also time the first response of two fresh processes on ``static-compile``, the first on an empty compile
    cache and the second on the cache the first filled (train/generate/first_response.py)."""
    profile_requests: int = allowed(4, ge=0)
    """Single requests profiled per ``generate`` path (train/generate/decode_profile.py: where each output token's
    time goes); 0: no profile."""
    truncate_prompts: Optional[str] = allowed(None, choices=(None, "left", "right"))
    """A prompt that leaves no room for ``max_new_tokens`` in the model's context: refused (null), or cut keeping
    its end (``left``) or its start (``right``)."""

    def __post_init__(self) -> None:
        check_fields(self, "generate")
        if isinstance(self.load_levels, list):  # the YAML list form: kept as the comma-separated string
            self.load_levels = ",".join(str(x) for x in self.load_levels)
        self.load_levels = str(self.load_levels)  # one level: YAML reads 0.5 as a number
        levels = comma_list(self.load_levels) or []
        try:
            shares = [float(x) for x in levels]
        except ValueError:
            shares = []
        if not shares or any(not 0 < s <= 1 for s in shares):
            raise UserError(f"generate.load_levels={self.load_levels!r}: expected comma-separated shares of the "
                            "maximum rate in (0, 1], e.g. 0.25,0.5,0.9")

    @property
    def levels(self) -> list[float]:
        return [float(x) for x in comma_list(self.load_levels) or []]
