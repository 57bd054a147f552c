"""What the search measured: each candidate's :class:`Decision`, in order, and the :class:`SearchResult` that
optimize.json holds, with its waterfall (baseline → each accepted lever's ratio → the confirmed end-to-end ratio)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from train.optimize.proposals import Candidate


@dataclass
class Decision:
    """One candidate's outcome, in search order."""

    candidate: Candidate
    accepted: bool
    reason: str
    ratio: Optional[dict] = None
    steady_ratio: Optional[dict] = None
    quality: Optional[dict] = None
    warmup_s: Optional[float] = None
    seconds: float = 0.0
    evidence_index: int = 0

    def as_dict(self) -> dict[str, Any]:
        c = self.candidate
        return {"lever": c.lever, "value": c.value, "overrides": c.overrides, "predicted": c.predicted,
                "evidence": c.evidence, "may_change": c.may_change, "accepted": self.accepted, "reason": self.reason,
                "ratio": self.ratio, "steady_ratio": self.steady_ratio, "quality": self.quality,
                "warmup_s": self.warmup_s, "seconds": self.seconds, "profile": self.evidence_index}


@dataclass
class SearchResult:
    """Everything the search measured (what optimize.json holds); ``status``: completed / budget / interrupted."""

    baseline: dict[str, Any]
    best: dict[str, Any]
    decisions: list[Decision] = field(default_factory=list)
    profiles: list[dict] = field(default_factory=list)
    rankings: list[list[dict]] = field(default_factory=list)
    not_applicable: dict[str, str] = field(default_factory=dict)
    not_tried: list[dict] = field(default_factory=list)
    confirmation: Optional[dict] = None
    status: str = "running"
    seconds: float = 0.0
    """Since the command started (its deadline's start: data preparation and set-up included)."""
    stop_reason: Optional[str] = None
    """Why the budget ended the search (``status`` budget): the work that did not fit, what was held and what was
    left."""

    def accepted(self) -> list[Decision]:
        return [d for d in self.decisions if d.accepted]

    def waterfall(self) -> dict[str, Any]:
        """Baseline 1.0 → each accepted lever's ratio multiplied in (median and interval bounds) → the confirmed
        end-to-end ratio; ``adds_up``: the confirmed median lies within the product of the accepted intervals."""
        steps, med, low, high = [], 1.0, 1.0, 1.0
        for d in self.accepted():
            r = d.ratio
            med, low, high = med * r["median"], low * r["low"], high * r["high"]
            steps.append({"lever": f"{d.candidate.lever}={d.candidate.value}", "ratio": r["median"],
                          "low": r["low"], "high": r["high"], "cumulative": med, "cumulative_low": low,
                          "cumulative_high": high})
        conf = (self.confirmation or {}).get("ratio") or {}
        final = conf.get("median")
        return {"steps": steps, "product": med, "product_low": low, "product_high": high,
                "confirmed": conf or None,
                "adds_up": None if final is None or not steps else bool(low <= final <= high)}

    def as_dict(self) -> dict[str, Any]:
        return {"status": self.status, "seconds": self.seconds, "stop_reason": self.stop_reason,
                "baseline": self.baseline, "best": self.best,
                "decisions": [d.as_dict() for d in self.decisions], "profiles": self.profiles,
                "rankings": self.rankings, "not_applicable": self.not_applicable, "not_tried": self.not_tried,
                "confirmation": self.confirmation, "waterfall": self.waterfall()}
