"""``make optimize``'s search with a fake lever catalogue of known effects: acceptance, rejection (no gain, harmful,
out of memory, raises, hangs), the interval logic, the timeout, the budget, the waterfall and interrupted runs."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import torch

from train.commands.optimize.levers import CATALOGUE, EXACT, NUMERICS, Candidate, Evidence, Lever, LeverContext, amdahl
from train.commands.optimize.outputs import write_outputs
from train.commands.optimize.search import (
    ArmTimeout,
    SearchSettings,
    amortise,
    failure_reason,
    quality_verdict,
    search,
    time_limit,
)
from train.config import RunConfig
from train.perf.ab import Ratio

BASE_MS = 6.0


class FakeArm:
    """A step that sleeps ``BASE_MS / speed`` ms and counts 8 samples; settings may make it fail or learn worse."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self.s = settings
        if settings.get("fake.oom_on_build"):
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        self.seen = 0

    def warmup(self, samples: int) -> float:
        while self.seen < samples:
            self.step()
        return float(self.s.get("fake.warmup_s", 0.0))

    def step(self) -> dict[str, float]:
        if self.s.get("fake.raise"):
            raise ValueError("this lever is broken")
        if self.s.get("fake.hang"):
            time.sleep(60)
        speed = 1.0
        for k, v in self.s.items():
            if k.startswith("fake.speed"):
                speed *= v
        time.sleep(BASE_MS / speed / 1e3)
        self.seen += 8
        return {"samples": 8}

    def quality(self) -> dict[str, Any]:
        loss = 1.0 * (3.0 if self.s.get("fake.harmful") else 1.0)
        return {"loss": loss, "nonfinite_steps": 5 if self.s.get("fake.nan") else 0}

    def close(self) -> None:
        pass


class FakeBackend:
    device = torch.device("cpu")

    def __init__(self) -> None:
        self.profiles = 0
        self.built: list[dict] = []

    def context(self, settings: dict[str, Any]) -> LeverContext:
        return LeverContext(cfg=RunConfig(), device_type="cpu")

    def profile(self, settings: dict[str, Any], index: int) -> Evidence:
        self.profiles += 1
        return Evidence(step_ms=BASE_MS, compute_share=0.5)

    def arm(self, name: str, settings: dict[str, Any]) -> FakeArm:
        self.built.append(dict(settings))
        return FakeArm(settings)


def lever(name: str, overrides: dict[str, Any], predicted: float, may_change: str = NUMERICS) -> Lever:
    def propose(ctx: LeverContext, ev: Evidence):
        return [Candidate(name, "on", overrides, predicted, "fake evidence", may_change)]

    return Lever(name, "fake", "anywhere", "none", may_change, propose)


def settings(**kw: Any) -> SearchSettings:
    base = dict(budget_s=120.0, rounds=5, window_samples=24, min_gain=1.05, quality_tolerance=0.05,
                arm_timeout_s=20.0, confirm_rounds=5)
    return SearchSettings(**{**base, **kw})


def test_search_keeps_the_fast_lever_and_rejects_the_rest_with_reasons():
    levers = (
        lever("fast", {"fake.speed": 2.0}, 1.9),
        lever("noop", {"fake.speed_noop": 1.0}, 1.8, EXACT),
        lever("harmful", {"fake.speed_h": 2.0, "fake.harmful": True}, 1.7),
        lever("nan", {"fake.speed_n": 2.0, "fake.nan": True}, 1.65),
        lever("oom", {"fake.oom_on_build": True}, 1.6),
        lever("broken", {"fake.raise": True}, 1.5),
        lever("hangs", {"fake.hang": True}, 1.4),
    )
    backend = FakeBackend()
    res = search(backend, levers, {}, settings(arm_timeout_s=3.0), notice=lambda _m: None)
    by = {d.candidate.lever: d for d in res.decisions}
    assert res.status == "completed"
    assert [d.candidate.lever for d in res.accepted()] == ["fast"]
    assert by["fast"].ratio["low"] >= 1.05 and 1.6 < by["fast"].ratio["median"] < 2.4
    assert "no measurable difference" in by["noop"].reason or "below optimize.min_gain" in by["noop"].reason
    assert by["harmful"].reason.startswith("quality guard: held-out loss 3.0000 >")
    assert "non-finite" in by["nan"].reason
    assert by["oom"].reason.startswith("out of memory")
    assert by["broken"].reason == "raised ValueError: this lever is broken"
    assert by["hangs"].reason.startswith("timed out: ran past optimize.arm_timeout_s=3 s (a hang")
    assert res.best == {"fake.speed": 2.0}
    assert backend.profiles == 2  # the baseline, and a re-profile after the accepted lever
    # the later candidates were measured against the new best
    assert {"fake.speed": 2.0, "fake.speed_noop": 1.0} in backend.built
    conf = res.confirmation["ratio"]
    assert conf["low"] > 1.05
    w = res.waterfall()
    assert w["steps"][0]["lever"] == "fast=on" and w["adds_up"] is not None


def test_budget_stops_the_search_and_lists_what_was_not_tried():
    t = [0.0]

    def clock() -> float:
        t[0] += 10.0  # every look at the clock: 10 s later
        return t[0]

    levers = tuple(lever(f"l{i}", {f"fake.speed{i}": 1.0}, 1.5 - i / 10) for i in range(4))
    res = search(FakeBackend(), levers, {}, settings(budget_s=60.0), clock=clock, notice=lambda _m: None)
    assert res.status == "budget"
    assert len(res.decisions) >= 1
    assert res.not_tried and all(n["reason"].startswith("budget:") for n in res.not_tried)
    assert len(res.decisions) + len(res.not_tried) == 4


def test_interrupt_returns_the_partial_result_and_writes_a_valid_report(tmp_path):
    levers = (lever("fast", {"fake.speed": 2.0}, 1.9), lever("later", {"fake.speed2": 1.0}, 1.5))
    written: list[dict] = []

    class Interrupting(FakeBackend):
        def arm(self, name, s):
            if "fake.speed2" in s:
                raise KeyboardInterrupt
            return super().arm(name, s)

    def update(res):
        d = res.as_dict()
        write_outputs(tmp_path, d, {"config": "fake", "budget_s": 120, "device": "cpu", "load": "0"},
                      RunConfig().with_values({"train.max_steps": 7}))
        written.append(d)

    res = search(Interrupting(), levers, {}, settings(), notice=lambda _m: None, on_update=update)
    assert res.status == "interrupted"
    assert [d.candidate.lever for d in res.decisions] == ["fast"]
    saved = json.loads((tmp_path / "optimize.json").read_text())
    assert saved["status"] == "interrupted" and saved["decisions"][0]["accepted"]
    assert "fast=on" in (tmp_path / "optimize.md").read_text()
    from train.config import load_config

    assert load_config(str(tmp_path / "optimized.yaml")).train.max_steps == 7


def test_interval_logic_single_round_and_min_gain():
    one = Ratio("a", "b", "samples", [1.5], 1.5, None, None)
    assert one.verdict == "one round: no interval" and not one.clears(1.0)
    r = Ratio("a", "b", "samples", [1.1, 1.2], 1.15, 1.1, 1.2)
    assert r.clears(1.1) and not r.clears(1.11)


def test_amortise_charges_the_one_off_cost_over_the_planned_run():
    r = Ratio("c", "b", "samples", [1.2, 1.3], 1.25, 1.2, 1.3)
    d = amortise(r, warmup_s=30.0, planned_s=100.0)  # 100 s at the best's speed → 80 s + 30 s
    assert d["median"] == pytest.approx(100 / (100 / 1.25 + 30))
    assert d["median"] < 1.0 and d["verdict"] == "slower"
    assert amortise(r, 0.0, 100.0)["median"] == 1.25


def test_quality_verdict():
    assert quality_verdict({"loss": 1.0}, {"loss": 1.04, "nonfinite_steps": 0}, 0.05)[0]
    ok, why = quality_verdict({"loss": 1.0}, {"loss": 1.2, "nonfinite_steps": 0}, 0.05)
    assert not ok and "1.2000 > 1.0500" in why
    assert not quality_verdict({"loss": 1.0}, {"loss": float("nan")}, 0.05)[0]


def test_time_limit_and_failure_reasons():
    with pytest.raises(ArmTimeout):
        with time_limit(0.2):
            time.sleep(5)
    assert failure_reason(RuntimeError("CUDA out of memory. Tried")).startswith("out of memory")
    assert failure_reason(MemoryError()).startswith("out of memory")
    assert failure_reason(ValueError("x")) == "raised ValueError: x"


def test_catalogue_levers_propose_from_the_evidence():
    cfg = RunConfig().with_values({"batching.method": "pad-to-max", "batching.max_tokens": None,
                                   "train.precision": "fp32", "model.fast_dropout": "false", "optim.fused": False})
    ctx = LeverContext(cfg=cfg, device_type="cpu", supports_packing=True, dropout_modules=3, native_bf16=True,
                       fused_adamw=True, cpu_count=2, torch_threads=2, planned_steps=600, batch_shapes=8,
                       base_budget=4096)
    ev = Evidence(step_ms=100.0, padding_share=0.8, compute_share=0.6, memory_share=0.2, launch_share=0.05,
                  data_wait_share=0.01, optimizer_share=0.1, other_share=0.02, dropout_mask_share=0.1)
    got = {lv.name: lv.propose(ctx, ev) for lv in CATALOGUE}
    assert {c.value for c in got["batching"]} == {"hf-group-by-length", "optimal", "packed"}
    packed = next(c for c in got["batching"] if c.value == "packed")
    assert packed.predicted == pytest.approx(amdahl(0.8 * 0.97, 1e9))
    assert got["precision"][0].overrides == {"train.precision": "bf16"}
    assert isinstance(got["token_budget"], str)  # pad-to-max takes a fixed batch
    assert got["fast_dropout"][0].may_change == "rng stream"
    assert "every core" in got["threads"]
    assert got["allocator"] == "CUDA caching allocator: CUDA only"
    no_bf16 = LeverContext(cfg=cfg, device_type="cpu", native_bf16=False)
    assert "no native bf16" in CATALOGUE[0].propose(no_bf16, ev)
    # packing is not offered to a model that cannot run packed rows
    ctx.supports_packing = False
    assert "packed" not in {c.value for c in CATALOGUE[1].propose(ctx, ev)}
    # the compile lever amortises its warm-up over the planned run: 600 steps x 100 ms = 60 s vs 160 s of compiling
    comp = next(lv for lv in CATALOGUE if lv.name == "compile").propose(ctx, ev)
    assert comp[0].predicted < 1.0


def test_token_budget_doubles_up_to_the_bound():
    cfg = RunConfig().with_values({"batching.method": "optimal", "batching.max_tokens": 8192})
    ctx = LeverContext(cfg=cfg, device_type="cpu", base_budget=4096)
    tb = next(lv for lv in CATALOGUE if lv.name == "token_budget")
    assert tb.propose(ctx, Evidence())[0].overrides == {"batching.max_tokens": 16384}
    ctx.cfg = cfg.with_values({"batching.max_tokens": 16384})
    assert "max_budget_factor" in tb.propose(ctx, Evidence())


def test_candidates_the_evidence_gives_nothing_to_gain_are_not_measured():
    levers = (lever("fast", {"fake.speed": 2.0}, 1.9), lever("nothing", {"fake.speed9": 1.0}, 1.001))
    res = search(FakeBackend(), levers, {}, settings(), notice=lambda _m: None)
    assert [d.candidate.lever for d in res.decisions] == ["fast"]
    assert res.not_tried == [{"lever": "nothing", "value": "on", "predicted": 1.001,
                              "reason": "the evidence predicts no gain (< 0.5%)"}]


def test_the_grid_crosses_every_crossable_lever():
    from train.commands.optimize.grid import grid_points, name_of

    base = RunConfig().with_values({"batching.batch_size": 32, "data.max_len": 128})
    pts = grid_points(base, native_bf16=True, supports_packing=True, fused=True, workers=1)
    # precision 2 x batching (pad-to-max, hf, optimal x 3 budgets, packed x 3 budgets) x dropout 2 x fused 2 x workers 2
    assert len(pts) == 2 * 8 * 2 * 2 * 2
    assert len({name_of(p) for p in pts}) == len(pts)
    assert {p["batching.max_tokens"] for p in pts if p["batching.method"] == "packed"} == {None, 4096, 8192}
    small = grid_points(base, native_bf16=False, supports_packing=False, fused=False, workers=0)
    assert len(small) == 1 * 5 * 2 * 1 * 1 and {p["train.precision"] for p in small} == {"fp32"}


def test_an_undecided_ab_gets_more_rounds_with_the_same_arms():
    from train.commands.optimize.search import measure_pair

    calls = []

    def extend(result) -> bool:
        calls.append(result.rounds)
        return True

    result, _warm, qa, qb = measure_pair(FakeBackend(), {}, {"fake.speed": 1.5}, settings(rounds=3), 3,
                                         extend=extend)
    assert calls == [3, 6] and result.rounds == 9  # max_extensions=2: two extensions of 3 rounds
    rounds = [w.round for w in result.arms["candidate"].windows]
    assert rounds == list(range(9))
    assert len(result.ratio("candidate", "best").per_round) == 9
