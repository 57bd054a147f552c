"""``make optimize``'s search with a fake lever catalogue of known effects: acceptance, rejection (no gain, harmful,
out of memory, raises, hangs), the interval logic, the timeout, the budget, the waterfall and interrupted runs."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import numpy as np
import pytest
import torch

from train.config import RunConfig, load_config
from train.optimize.arms import ArmTimeout, failure_reason, time_limit
from train.optimize.deadline import Deadline, budget_reason, overshoot_allowed
from train.optimize.judging import amortise, quality_verdict
from train.optimize.levers import CATALOGUE
from train.optimize.outputs import write_outputs
from train.optimize.proposals import EXACT, NUMERICS, Candidate, Evidence, Lever, LeverContext, amdahl
from train.optimize.search import search
from train.optimize.settings import SearchSettings
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
        if self.s.get("fake.tokens_per_sample"):  # a batching that holds other samples per step: count the tokens
            return {"samples": 8, "real_tokens": 8 * self.s["fake.tokens_per_sample"]}
        return {"samples": 8}

    def quality(self) -> dict[str, Any]:
        loss = 1.0 * (3.0 if self.s.get("fake.harmful") else 1.0)
        loss *= 1.5 if self.seen < self.s.get("fake.learns_late", 0) else 1.0  # fewer steps: behind early on
        return {"loss": loss, "nonfinite_steps": 5 if self.s.get("fake.nan") else 0, "samples_seen": self.seen}

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

    def schedule(self, settings: dict[str, Any]) -> dict[str, Any]:
        return {}


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


class SimClock:
    """Simulated seconds: the Deadline and the simulated arms share it, nothing sleeps."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


class SimArm:
    """A step of ``step_s / speed`` simulated seconds and 8 samples (the window's time is the arm's own ``seconds``);
    a build of ``build_s``, a quality read of ``quality_s``."""

    def __init__(self, backend: "SimBackend", settings: dict[str, Any]) -> None:
        self.b, self.s, self.seen = backend, settings, 0
        self.b.clock.advance(self.b.build_s)

    def warmup(self, samples: int) -> float:
        while self.seen < samples:
            self.step()
        return 0.0

    def step(self) -> dict[str, float]:
        speed = 1.0
        for k, v in self.s.items():
            if k.startswith("fake.speed"):
                speed *= v
        dt = self.b.step_s / speed
        self.b.clock.advance(dt)
        self.b.steps_at.append(self.b.clock.t)
        self.seen += 8
        return {"samples": 8, "seconds": dt}

    def quality(self) -> dict[str, Any]:
        self.b.clock.advance(self.b.quality_s)
        return {"loss": 1.0, "nonfinite_steps": 0, "samples_seen": self.seen}

    def close(self) -> None:
        pass


class SimBackend(FakeBackend):
    """FakeBackend on simulated time: a profile of ``profile_s`` (it builds the baseline and steps it), arms whose
    steps take ``step_s`` (at speed 1)."""

    def __init__(self, clock: SimClock, step_s: float = 0.25, build_s: float = 1.0, quality_s: float = 0.5,
                 profile_s: float = 3.0) -> None:
        super().__init__()
        self.clock, self.step_s, self.build_s, self.quality_s, self.profile_s = (clock, step_s, build_s, quality_s,
                                                                               profile_s)
        self.steps_at: list[float] = []

    def profile(self, settings: dict[str, Any], index: int) -> Evidence:
        self.profiles += 1
        self.clock.advance(self.profile_s)
        return Evidence(step_ms=1e3 * self.step_s, compute_share=0.5, samples_per_s=8 / self.step_s)

    def arm(self, name: str, settings: dict[str, Any]) -> SimArm:
        self.built.append(dict(settings))
        return SimArm(self, settings)


BUDGET_WORDS = re.compile(r"budget: (?P<what>.+?) needs ~(?P<need>\d+) s(?: and ~(?P<held>\d+) s are held for "
                          r"(?P<why>[^;]+))?; (?P<left>\d+) s left of (?P<limit>\S+)")


def budget_texts(res: Any) -> list[str]:
    """Every reason the search gave that mentions the budget."""
    texts = [n["reason"] for n in res.not_tried] + [d.reason for d in res.decisions] + [res.stop_reason or ""]
    conf = res.confirmation or {}
    texts += [conf.get("unavailable_reason") or "", conf.get("cut_short") or ""]
    return [t for t in texts if "budget:" in t]


def assert_consistent(texts: list[str], kept: bool) -> None:
    """Each ``needs ~N s (and ~H s are held for …); L s left`` says a shortage: N + H > L; a hold is said only once
    something is kept (or, within an A/B, its candidate clears min_gain), and says what for."""
    for t in texts:
        for m in BUDGET_WORDS.finditer(t):
            need, held, left = int(m["need"]), int(m["held"] or 0), int(m["left"])
            assert need + held > left, t
            if m["held"]:
                assert "final confirmation" in m["why"], t
                assert kept, t
        if not BUDGET_WORDS.search(t):
            assert "has passed" in t, t


SIM_LEVERS = (lever("fast", {"fake.speed": 2.0}, 1.9), lever("same", {"fake.speed_s": 1.0}, 1.5),
              lever("other", {"fake.speed_o": 1.0}, 1.4), lever("more", {"fake.speed_m": 1.0}, 1.3))


@pytest.mark.parametrize("budget", [20.0, 45.0, 60.0, 90.0, 120.0, 180.0])
def test_the_search_ends_within_its_budget_and_says_why_it_stopped(budget):
    """Windows of a fixed simulated time: wherever the budget falls (before the first A/B, inside one, before the
    confirmation), the search ends by budget + overshoot_allowed — here within one window of it — and every reason
    adds up. On today's code the first A/B and the confirmation ran whatever was left (292 s for a 20 s budget)."""
    clock = SimClock()
    backend = SimBackend(clock)
    dl = Deadline(budget, start=0.0, clock=clock)
    clock.advance(5.0)  # the command's set-up and data preparation, before the search: spent too
    res = search(backend, SIM_LEVERS, {}, settings(budget_s=budget, rounds=5, confirm_rounds=6),
                 notice=lambda _m: None, deadline=dl)
    window_s = 24 / 8 * backend.step_s  # 24-sample windows of 8-sample steps
    assert clock.t <= budget + 2 * window_s, (clock.t, res.stop_reason)
    assert clock.t <= budget + overshoot_allowed(budget)
    assert res.seconds == pytest.approx(clock.t)
    assert res.status in ("budget", "completed")
    assert_consistent(budget_texts(res), kept=bool(res.accepted()))
    if res.status == "budget":
        assert res.stop_reason or any("cut short" in d.reason for d in res.decisions)
    if res.accepted():  # something kept: the confirmation ran, or the reason says why it could not
        conf = res.confirmation
        assert (conf["ratio"] and conf["ratio"]["low"] is not None) or conf["unavailable_reason"].startswith("budget:")
    if budget >= 45:  # the confirmation is held for once "fast" clears min_gain
        assert res.confirmation["ratio"]["low"] is not None
    if budget >= 60:  # room for everything (the whole search takes ~54 s)
        assert res.status == "completed" and [d.candidate.lever for d in res.accepted()] == ["fast"]
        assert res.confirmation["cut_short"] is None and len(res.decisions) == 4


def test_nothing_kept_holds_nothing_back_for_a_confirmation():
    """The 180 s run that stopped at 123 s with "budget: ~28 s needed, 57 s left": the time was held for a
    confirmation that could never run. With nothing kept, every A/B that fits is measured, and no reason speaks of a
    hold."""
    clock = SimClock()
    levers = tuple(lever(f"n{i}", {f"fake.speed{i}": 1.0}, 1.5 - i / 20) for i in range(10))  # 12 s per A/B
    res = search(SimBackend(clock), levers, {}, settings(budget_s=57.0), notice=lambda _m: None,
                 deadline=Deadline(57.0, start=0.0, clock=clock))  # a 3 s profile, 4 A/Bs: 51 s; 6 s left
    assert not res.accepted() and res.confirmation is None
    texts = budget_texts(res)
    assert texts and not any("held" in t for t in texts)
    assert_consistent(texts, kept=False)
    # it stopped because the next A/B's two rounds did not fit, not earlier: nothing was held
    m = BUDGET_WORDS.search(res.stop_reason)
    assert m and int(m["need"]) > int(m["left"]) and not m["held"], res.stop_reason
    assert int(m["left"]) == 6 and clock.t == 51.0 and len(res.decisions) == 4
    assert len(res.not_tried) == 6 and all(n["reason"].startswith("budget: its A/B") for n in res.not_tried)


def test_a_kept_lever_holds_its_confirmation_and_says_so():
    clock = SimClock()
    res = search(SimBackend(clock), SIM_LEVERS, {}, settings(budget_s=45.0, confirm_rounds=6),
                 notice=lambda _m: None, deadline=Deadline(45.0, start=0.0, clock=clock))
    assert [d.candidate.lever for d in res.accepted()] == ["fast"]
    texts = budget_texts(res)
    assert any("held for the final confirmation" in t for t in texts), texts
    assert_consistent(texts, kept=True)
    assert res.status == "budget" and len(res.decisions) < len(SIM_LEVERS)
    assert res.confirmation["ratio"]["low"] is not None and clock.t <= 45.0 + 2 * 0.75


def test_the_baselines_profile_and_the_set_up_count_against_the_budget():
    """Set-up (20 s) and a profile of the baseline (60 s) take 80 % of a 100 s budget: no A/B fits what is left, so
    none is started and the search ends within the allowed overshoot, saying why."""
    clock = SimClock()
    backend = SimBackend(clock, profile_s=60.0)
    dl = Deadline(100.0, start=0.0, clock=clock)
    clock.advance(20.0)
    res = search(backend, SIM_LEVERS, {}, settings(budget_s=100.0), notice=lambda _m: None, deadline=dl)
    assert clock.t <= 100.0 + overshoot_allowed(100.0)
    assert res.status == "budget" and not res.decisions and not backend.built
    assert res.stop_reason.startswith("budget: its A/B (2 rounds at the least) needs ~")
    assert_consistent(budget_texts(res), kept=False)
    assert {n["lever"] for n in res.not_tried} == {"fast", "same", "other", "more"}
    # the set-up alone past the budget: not even the first profile
    clock2 = SimClock()
    dl2 = Deadline(100.0, start=0.0, clock=clock2)
    clock2.advance(101.0)
    backend2 = SimBackend(clock2)
    res2 = search(backend2, SIM_LEVERS, {}, settings(budget_s=100.0), notice=lambda _m: None, deadline=dl2)
    assert res2.status == "budget" and backend2.profiles == 0 and "has passed" in res2.stop_reason


def test_an_ab_that_cannot_finish_its_rounds_is_cut_short_and_judged_on_what_it_has():
    from train.optimize.pairs import measure_pair

    clock = SimClock()
    backend = SimBackend(clock, step_s=1.0, build_s=0.0, quality_s=0.0)  # windows of 3 s
    dl = Deadline(32.0, start=0.0, clock=clock)  # warm-ups 2 × 3 s, then 4 rounds of 6 s fit, not 5
    m = measure_pair(backend, {}, {"fake.speed": 1.0}, settings(rounds=5), 5, deadline=dl)
    assert m.result.rounds == 4 and all(len(a.windows) == 4 for a in m.result.arms.values())
    assert m.cut_short == ("cut short after 4 timed round(s): budget: round 5 of 5 needs ~6 s; 2 s left of "
                           "optimize.budget_s=32")
    assert backend.steps_at[-1] == 30.0  # no window started that would end past the deadline
    assert m.quality_best and m.quality_candidate  # read where the rounds stopped
    assert_consistent([m.cut_short], kept=False)
    # via the search: the decision says it was cut short
    clock = SimClock()
    backend = SimBackend(clock, step_s=1.0, build_s=0.0, quality_s=0.0, profile_s=0.0)
    res = search(backend, (lever("fast", {"fake.speed": 2.0}, 1.9),), {},
                 settings(budget_s=25.0, confirm_rounds=2), notice=lambda _m: None,
                 deadline=Deadline(25.0, start=0.0, clock=clock))
    d = res.decisions[0]
    assert "cut short after" in d.reason and res.status == "budget" and clock.t <= 25.0 + 3.0


def test_a_warm_up_stops_at_the_deadline():
    """Warm-up steps are untimed but not free: none starts once the deadline has passed (OutOfTime), and the search
    records the A/B as not measured, for the budget."""
    from train.optimize.deadline import OutOfTime
    from train.optimize.pairs import measure_pair

    clock = SimClock()
    backend = SimBackend(clock, step_s=1.0, build_s=0.0, quality_s=0.0)
    with pytest.raises(OutOfTime, match=r"^budget: warming candidate up \(16 of 24 samples\) not started"):
        measure_pair(backend, {}, {"fake.speed": 1.0}, settings(rounds=5), 5,
                     deadline=Deadline(5.0, start=0.0, clock=clock))  # best's 3 steps, then 2 of candidate's
    assert clock.t == 5.0

    class Optimistic(SimBackend):  # its profile says 10x faster than its arms run: the A/B starts, and cannot finish
        def profile(self, settings: dict[str, Any], index: int) -> Evidence:
            ev = super().profile(settings, index)
            ev.samples_per_s *= 10
            return ev

    clock = SimClock()
    backend = Optimistic(clock, step_s=1.0, build_s=0.0, quality_s=0.0, profile_s=1.0)
    res = search(backend, (lever("same", {"fake.speed_s": 1.0}, 1.9),), {}, settings(budget_s=6.0),
                 notice=lambda _m: None, deadline=Deadline(6.0, start=0.0, clock=clock))
    assert res.decisions[0].reason.startswith("budget: warming candidate up (16 of 24 samples) not started")
    assert not res.accepted() and clock.t <= 6.0 + 1.0
    assert res.status == "budget"


def test_the_arm_time_limit_bounds_an_ab_by_its_windows_too():
    """optimize.arm_timeout_s is a bound of the same kind: a slow candidate's A/B stops starting windows before it,
    not only when SIGALRM interrupts a hang."""
    clock = SimClock()
    backend = SimBackend(clock, step_s=1.0, build_s=0.0, quality_s=0.0, profile_s=0.0)
    res = search(backend, (lever("slow", {"fake.speed": 0.5}, 1.9),), {},
                 settings(budget_s=1000.0, arm_timeout_s=40.0), notice=lambda _m: None,
                 deadline=Deadline(1000.0, start=0.0, clock=clock))
    d = res.decisions[0]
    assert "optimize.arm_timeout_s=40" in d.reason and "cut short" in d.reason
    assert d.seconds <= 40.0


def test_budget_reason_never_claims_a_shortage_that_is_not_one():
    clock = SimClock()
    for budget, at, held, need in [(180, 123, 0, 28), (180, 123, 35, 28), (60, 59.6, 0, 0.3), (60, 10, 49.5, 0.6),
                                   (60, 61, 0, 5), (30, 0, 0, 29.9)]:
        clock.t = 0.0
        dl = Deadline(budget, start=0.0, clock=clock).less(held, "the final confirmation of what was kept")
        clock.t = at
        why = budget_reason(dl, "its A/B", need)
        if need + held <= budget - at:
            assert why is None, why
        else:
            assert why is not None and why.startswith("budget: its A/B")
            assert_consistent([why], kept=True)
    assert overshoot_allowed(20) == 30 and overshoot_allowed(900) == 90


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
    assert {c.value for c in got["batching"]} == {"optimal", "optimal+batch-max", "packed"}
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


def test_the_chunked_loss_lever_is_offered_to_causal_lms_ranked_by_the_loss_stage():
    lever = next(lv for lv in CATALOGUE if lv.name == "chunked_loss")
    ev = Evidence(step_ms=100.0, loss_share=0.3)
    classifier = LeverContext(cfg=RunConfig(), device_type="cpu")
    assert "nothing to chunk" in lever.propose(classifier, ev)
    causal = RunConfig().with_values({"model.task": "causal-lm", "model.source": "hf:llama",
                                      "model.chunked_loss": "false"})
    (cand,) = lever.propose(LeverContext(cfg=causal, device_type="cpu"), ev)
    assert cand.overrides == {"model.chunked_loss": "true"} and cand.may_change == NUMERICS
    assert cand.predicted == pytest.approx(amdahl(0.3, 2.0)) and "30.0%" in cand.evidence
    on = causal.with_values({"model.chunked_loss": "true"})
    assert lever.propose(LeverContext(cfg=on, device_type="cpu"), ev) == "already on"


def test_the_attention_lever_offers_packed_rows_the_other_paths_ranked_by_the_attention_share():
    from train.data.layout_cost import LayoutCost
    from train.optimize.command import baseline_settings

    lever = next(lv for lv in CATALOGUE if lv.name == "attention")
    ev = Evidence(step_ms=100.0, attention_share=0.25, top_op="aten::_scaled_dot_product_flash_attention_for_cpu")
    causal = RunConfig().with_values({"model.task": "causal-lm", "model.source": "hf:llama", "train.precision": "bf16",
                                      "batching.method": "packed", "model.packed_attention": "sdpa-mask"})
    costs = {"current": LayoutCost(tokens=21.6, scores=1382.0, real_tokens=21.5),
             "optimal+batch-max": LayoutCost(tokens=24.2, scores=691.0, real_tokens=21.5)}
    paths = {"varlen": "", "eager-mask": ""}
    ctx = LeverContext(cfg=causal, device_type="cpu", attention_paths=paths, batching_costs=costs)
    got = {c.value: c for c in lever.propose(ctx, ev)}
    assert got["eager-mask"].overrides == {"model.packed_attention": "eager-mask"}
    assert got["eager-mask"].predicted == pytest.approx(amdahl(0.25, 2.0)) and "25.0%" in got["eager-mask"].evidence
    assert got["varlen"].predicted == pytest.approx(amdahl(0.25, 2.0)) and "1382 -> 691" in got["varlen"].evidence
    assert all(c.may_change == NUMERICS for c in got.values())
    # fp32: eager-mask ranks no gain; compiled: varlen would recompile; CUDA: the fused kernel stays
    fp32 = lever.propose(LeverContext(cfg=causal.with_values({"train.precision": "fp32"}), device_type="cpu",
                                      attention_paths=paths, batching_costs=costs), ev)
    assert {c.value: c.predicted for c in fp32}["eager-mask"] == 1.0
    compiled = LeverContext(cfg=causal.with_values({"compile.enabled": "true"}), device_type="cuda",
                            attention_paths=paths, batching_costs=costs)
    why = lever.propose(compiled, ev)
    assert isinstance(why, str) and "recompile" in why and "fused kernel" in why
    assert "batching.method=optimal" in lever.propose(LeverContext(cfg=causal.with_values(
        {"batching.method": "optimal"}), device_type="cpu", attention_paths=paths), ev)
    assert "no other path" in lever.propose(LeverContext(cfg=causal, device_type="cpu"), ev)
    # the baseline runs the block mask: the other paths are this lever's, never auto's inside an arm
    settings, notes = baseline_settings(causal.with_values({"model.packed_attention": "auto"}), "bf16")
    assert settings["model.packed_attention"] == "sdpa-mask" and any("attention lever" in n for n in notes)


def test_token_budget_doubles_up_to_the_bound():
    cfg = RunConfig().with_values({"batching.method": "optimal", "batching.max_tokens": 8192})
    ctx = LeverContext(cfg=cfg, device_type="cpu", base_budget=4096)
    tb = next(lv for lv in CATALOGUE if lv.name == "token_budget")
    up, down = tb.propose(ctx, Evidence(optimizer_share=0.02))
    assert up.overrides == {"batching.max_tokens": 16384}
    # the rung below the budget in place: predicted slower from the per-step overhead, near-neutral (measured last)
    assert down.overrides == {"batching.max_tokens": 4096} and down.predicted == pytest.approx(amdahl(0.02, 0.5))
    assert 0.97 <= down.predicted < 1.0 and "the rung down" in down.evidence
    ctx.cfg = cfg.with_values({"batching.max_tokens": 16384})
    assert [c.value for c in tb.propose(ctx, Evidence())] == ["8192"]  # the top of the ladder: only the rung down
    ctx.cfg = cfg.with_values({"batching.max_tokens": 512})
    assert [c.value for c in tb.propose(ctx, Evidence())] == ["1024", "2048"]  # the bottom: nothing below
    # from a fixed batch of 32 samples of 30 padded tokens (960 per step): the smallest budget of the ladder with at
    # least 1.5x the tokens per step, predicted from the per-step overhead spread over 2048 / 960 the tokens
    from train.data.layout_cost import LayoutCost

    ctx.cfg = cfg.with_values({"batching.max_tokens": None, "batching.batch_size": 32, "data.max_len": 128})
    ctx.batching_costs = {"current": LayoutCost(tokens=30.0, scores=900.0, real_tokens=27.0, samples_per_step=32.0)}
    c, c2 = tb.propose(ctx, Evidence(optimizer_share=0.2))  # the next two rungs
    assert c.overrides == {"batching.max_tokens": 2048} and c.predicted == pytest.approx(amdahl(0.2, 2048 / 960))
    assert c2.overrides == {"batching.max_tokens": 4096} and c2.predicted > c.predicted
    # from a fixed batch padded to its longest sample (the HF Trainer's group_by_length), the budget comes with
    # fitted buckets padded the same way, its prediction times their layout's (here: less padding, 27 vs 30 tokens)
    ctx.cfg = ctx.cfg.with_values({"batching.method": "hf-group-by-length"})
    ctx.batching_costs["optimal+batch-max"] = LayoutCost(tokens=27.0, scores=729.0, real_tokens=27.0,
                                                         samples_per_step=70.0)
    c, _ = tb.propose(ctx, Evidence(optimizer_share=0.2, attention_share=0.0))
    assert c.overrides == {"batching.method": "optimal", "batching.pad_to": "batch-max", "batching.max_tokens": 2048}
    assert c.predicted == pytest.approx(amdahl(0.2, 2048 / 960) * 30 / 27)
    assert "batching.method=hf-group-by-length takes a fixed batch size" in c.evidence
    ctx.cfg = ctx.cfg.with_values({"batching.method": "pad-to-max"})  # there the batching lever comes first
    assert "takes a fixed batch size" in tb.propose(ctx, Evidence(optimizer_share=0.2))


def test_candidates_the_evidence_gives_nothing_to_gain_are_not_measured():
    levers = (lever("fast", {"fake.speed": 2.0}, 1.9), lever("nothing", {"fake.speed9": 1.0}, 1.001))
    res = search(FakeBackend(), levers, {}, settings(), notice=lambda _m: None)
    assert [d.candidate.lever for d in res.decisions] == ["fast"]
    assert res.not_tried == [{"lever": "nothing", "value": "on", "predicted": 1.001,
                              "reason": "the evidence predicts no gain (< 0.5%)"}]


def test_an_exact_lever_whose_bound_is_below_min_gain_is_not_measured():
    """An exact lever predicts its bound (its whole share removed): one DataLoader worker against 1.1 % data wait gains
    at most 1.011x, which optimize.min_gain (here 1.05) could accept only by chance — a reason, not an A/B; a lever
    that changes the training with the same prediction is still measured (its prediction is an estimate)."""
    levers = (lever("workers", {"fake.speed_w": 1.0}, 1.04, EXACT), lever("numerics", {"fake.speed_n": 1.0}, 1.04))
    res = search(FakeBackend(), levers, {}, settings(), notice=lambda _m: None)
    assert [d.candidate.lever for d in res.decisions] == ["numerics"]
    assert res.not_applicable["workers"] == ("workers=on gains at most 1.040x (fake evidence, all of it removed): "
                                             "below optimize.min_gain=1.05")
    res = search(FakeBackend(), levers, {}, settings(min_gain=1.02), notice=lambda _m: None)
    assert sorted(d.candidate.lever for d in res.decisions) == ["numerics", "workers"]


def test_near_neutral_candidates_are_measured_last_while_the_budget_lasts():
    """A candidate predicted within the cost models' error of 1.0 (here 0.99x, really 2x faster) is measured after
    every promising one when optimize.min_predicted reaches below it, and kept on its A/B; one predicted below the
    floor never is; with the floor at 1.005 none of them is measured."""
    levers = (lever("fast", {"fake.speed": 1.5}, 1.9), lever("neutral", {"fake.speed_n": 2.0}, 0.99),
              lever("slow", {"fake.speed_s": 2.0}, 0.9))
    res = search(FakeBackend(), levers, {}, settings(min_predicted=0.97), notice=lambda _m: None)
    assert [d.candidate.lever for d in res.decisions] == ["fast", "neutral"]  # the promising one first
    neutral = res.decisions[1]
    assert neutral.accepted and "near-neutral (predicted 0.990x" in neutral.candidate.evidence
    assert res.best == {"fake.speed": 1.5, "fake.speed_n": 2.0}
    assert res.not_tried == [{"lever": "slow", "value": "on", "predicted": 0.9,
                              "reason": "the evidence predicts a slowdown"}]
    res = search(FakeBackend(), levers, {}, settings(), notice=lambda _m: None)  # the floor at NO_GAIN
    assert [d.candidate.lever for d in res.decisions] == ["fast"]
    assert [n["lever"] for n in res.not_tried] == ["neutral", "slow"]


def test_near_neutral_candidates_wait_for_the_budget():
    t = [0.0]

    def clock() -> float:
        t[0] += 10.0
        return t[0]

    levers = (lever("a", {"fake.speed": 1.0}, 1.5), lever("b", {"fake.speed2": 1.0}, 1.4),
              lever("neutral", {"fake.speed_n": 2.0}, 0.99))
    res = search(FakeBackend(), levers, {}, settings(budget_s=60.0, min_predicted=0.97), clock=clock,
                 notice=lambda _m: None)
    assert res.status == "budget" and "neutral" not in [d.candidate.lever for d in res.decisions]
    assert any(n["lever"] == "neutral" and n["reason"].startswith("budget:") for n in res.not_tried)


def test_the_batching_lever_weighs_attention_scores_against_padding():
    """From packed rows, fitted buckets are predicted faster when attention is a large share of the step (each packed
    row attends C x C, a bucketed sample only B x B) and slower when it is small; layout costs come from the data."""
    from train.data.layout_cost import LayoutCost
    from train.optimize.levers import batching_speedup

    packed = LayoutCost(tokens=26.8, scores=3425.0, real_tokens=26.7)
    buckets = LayoutCost(tokens=30.2, scores=1159.0, real_tokens=26.7)
    assert batching_speedup(packed, buckets, 0.0) == pytest.approx(26.8 / 30.2)  # tokens alone: packing wins
    assert batching_speedup(packed, buckets, 0.4) > 1.2 > 1 > batching_speedup(packed, buckets, 0.05)
    cfg = RunConfig().with_values({"batching.method": "packed", "batching.max_tokens": 4096})
    ev = Evidence(step_ms=100.0, padding_share=0.003, attention_share=0.4)
    ctx = LeverContext(cfg=cfg, device_type="cpu", supports_packing=True,
                       batching_costs={"current": packed, "optimal": buckets, "optimal+batch-max": buckets})
    best = sorted(next(lv for lv in CATALOGUE if lv.name == "batching").propose(ctx, ev), key=lambda c: -c.predicted)
    assert best[0].value in ("optimal", "optimal+batch-max") and best[0].predicted > 1.2
    assert best[0].overrides["batching.method"] == "optimal" and "attention 40.0%" in best[0].evidence
    ctx.batching_costs = {}  # without layout costs: the padding share alone (nothing to gain from 0.3 %)
    assert all(c.predicted < 1.005 for c in CATALOGUE[1].propose(ctx, ev))


def test_layout_costs_of_each_batching_method(tiny_cfg):
    from train.data import prepare_data
    from train.data.layout_cost import layout_cost
    from train.setup import replan

    cfg = tiny_cfg("batching.max_tokens=256")
    bundle = prepare_data(cfg, None, notice=lambda _m: None)
    lengths = bundle.splits["train"].lengths
    costs = {}
    for name, over in (("pad-to-max", {"batching.method": "pad-to-max"}), ("optimal", {}),
                       ("batch-max", {"batching.pad_to": "batch-max"}), ("packed", {"batching.method": "packed"}),
                       ("hf", {"batching.method": "hf-group-by-length"})):
        c = cfg.with_values(over)
        costs[name] = layout_cost(c, lengths, replan(c, bundle).bounds)
    real = float(np.mean(np.minimum(lengths, 32)))
    assert costs["pad-to-max"].tokens == 32 and costs["pad-to-max"].scores == 32 * 32
    assert all(c.real_tokens == pytest.approx(real) for c in costs.values())
    assert real <= costs["packed"].tokens < costs["batch-max"].tokens <= costs["optimal"].tokens < 32
    assert costs["packed"].scores == pytest.approx(costs["packed"].tokens * 32)  # every row attends 32 x 32
    assert costs["optimal"].scores < costs["packed"].scores  # short samples: buckets attend less than packed rows
    assert real < costs["hf"].tokens < 32 and costs["hf"].scores < 32 * 32
    # samples per optimizer step: a budget of 256 tokens holds 8 samples padded to 32, more of the shorter buckets;
    # a fixed batch size holds batch_size (its last batch may be short)
    assert costs["pad-to-max"].samples_per_step == pytest.approx(8, rel=0.05)
    assert costs["optimal"].samples_per_step > 9
    assert costs["hf"].samples_per_step == pytest.approx(cfg.batching.batch_size, rel=0.05)


def test_a_lever_that_changes_the_samples_per_step_keeps_the_schedule_in_samples():
    """A token budget k times the samples per step: k times fewer steps, warm-up and evaluations over the same
    samples, and the square-root learning-rate rule (or linear, or none)."""
    from train.optimize.schedule import schedule_in_samples

    base = RunConfig().with_values({"train.max_steps": 600, "train.eval_every": 200, "train.checkpoint_every": None,
                                    "optim.lr": 2e-3})
    got = schedule_in_samples(base, 4.0, "sqrt")
    assert got == {"optim.lr": 4e-3, "train.max_steps": 150, "train.eval_every": 50, "train.checkpoint_every": None}
    assert schedule_in_samples(base, 4.0, "linear")["optim.lr"] == 8e-3
    assert schedule_in_samples(base, 4.0, "none")["optim.lr"] == 2e-3
    assert schedule_in_samples(base, 1.01, "sqrt") == {"optim.lr": 2e-3, "train.max_steps": 600,
                                                       "train.eval_every": 200, "train.checkpoint_every": None}
    with pytest.raises(ValueError):
        schedule_in_samples(base, 0.0, "sqrt")


def test_the_search_adds_the_schedule_a_candidate_needs_and_says_so():
    class Scheduled(FakeBackend):
        def schedule(self, s):
            return {"optim.lr": 0.004, "train.max_steps": 150} if "fake.speed" in s else {}

    backend = Scheduled()
    res = search(backend, (lever("budget", {"fake.speed": 2.0}, 1.9),), {}, settings(), notice=lambda _m: None)
    d = res.decisions[0]
    assert d.accepted and res.best == {"fake.speed": 2.0, "optim.lr": 0.004, "train.max_steps": 150}
    assert "the schedule kept in samples: optim.lr 0.001 -> 0.004, train.max_steps None -> 150" in d.candidate.evidence
    assert {"fake.speed": 2.0, "optim.lr": 0.004, "train.max_steps": 150} in backend.built


def test_real_arms_of_one_config_learn_identically_however_they_are_interleaved(tiny_cfg, tmp_path):
    """Each arm draws its dropout masks from its own stream (common random numbers): two arms of the same config,
    stepped alternately, reach the same held-out loss; on one shared stream they would not (the second arm's masks
    would be the first's continuation)."""
    from train.data import prepare_data
    from train.optimize.backend import RunBackend

    cfg = tiny_cfg("batching.method=optimal", "model.dropout=0.3", "optimize.quality_samples=64")
    bundle = prepare_data(cfg, None, notice=lambda _m: None)
    backend = RunBackend(cfg, bundle, torch.device("cpu"), tmp_path / "o", notice=lambda _m: None)
    a, b = backend.arm("a", {}), backend.arm("b", {})
    for _ in range(6):
        a.step()
        torch.rand(1000)  # anything else drawing from the global stream in between
        b.step()
        b.step() if _ == 0 else None  # and b one step ahead for a while
        a.step() if _ == 0 else None
    qa, qb = a.quality(), b.quality()
    assert qa["samples_seen"] == qb["samples_seen"]
    assert qa["loss"] == qb["loss"]
    c = backend.arm("c", {})  # the same config on the shared stream, for contrast: it learns otherwise
    for _ in range(7):
        torch.rand(1000)
        c.run.trainer.step()
    assert c.quality()["loss"] != qa["loss"]


def test_the_real_profile_times_a_step_without_the_profiler_and_stops_at_the_deadline(tiny_cfg, tmp_path):
    """The profile gives the search its first time estimates (a step before the profiler records, its build), and
    starts no step that would end past the command's deadline: OutOfTime, with a reason that adds up."""
    from train.data import prepare_data
    from train.optimize.backend import RunBackend
    from train.optimize.deadline import OutOfTime

    cfg = tiny_cfg("batching.method=optimal", "optimize.profile_steps=2")
    bundle = prepare_data(cfg, None, notice=lambda _m: None)
    backend = RunBackend(cfg, bundle, torch.device("cpu"), tmp_path / "o", notice=lambda _m: None,
                         deadline=Deadline(600.0))
    ev = backend.profile({}, 0)
    assert ev.unprofiled_samples_per_s > 0 and ev.samples_per_s > 0 and ev.steps_s > 0
    clock = SimClock()
    backend.deadline = Deadline(10.0, start=0.0, clock=clock)
    clock.advance(10.0)  # spent before the profile
    with pytest.raises(OutOfTime, match=r"^budget: the profile's step 1 of 5 not started: optimize.budget_s=10 has "
                                        r"passed"):
        backend.profile({}, 1)


def test_the_real_backend_scales_the_schedule_by_the_measured_samples_per_step(tiny_cfg, tmp_path):
    from train.data import prepare_data
    from train.optimize.backend import RunBackend

    cfg = tiny_cfg("batching.method=optimal", "train.max_steps=400", "train.eval_every=100",
                   "train.checkpoint_every=null")
    bundle = prepare_data(cfg, None, notice=lambda _m: None)
    backend = RunBackend(cfg, bundle, torch.device("cpu"), tmp_path / "o", notice=lambda _m: None)
    assert backend.schedule({"train.precision": "bf16"}) == {}  # the same samples per step
    assert set(backend.schedule({"batching.max_tokens": 2048})) == {"train.max_steps", "train.eval_every"}  # lr kept
    cfg = cfg.with_values({"optimize.lr_scaling": "sqrt"})
    backend = RunBackend(cfg, bundle, torch.device("cpu"), tmp_path / "o", notice=lambda _m: None)
    got = backend.schedule({"batching.max_tokens": 2048})
    k = 400 / got["train.max_steps"]
    assert k > 3 and got["optim.lr"] == pytest.approx(5e-3 * k ** 0.5, rel=0.02)
    assert abs(got["train.eval_every"] - 100 / k) <= 1
    # already on that schedule: nothing more to set
    assert backend.schedule({"batching.max_tokens": 2048, **got}) == {}


def test_the_grid_crosses_every_crossable_lever():
    from train.optimize.grid_space import grid_points, name_of

    base = RunConfig().with_values({"batching.batch_size": 32, "data.max_len": 128})
    pts = grid_points(base, native_bf16=True, supports_packing=True, fused=True, workers=1)
    # precision 2 x batching (pad-to-max, hf, optimal and optimal+batch-max and packed x 4 budgets) x dropout 2
    # x fused 2 x workers 2
    assert len(pts) == 2 * 14 * 2 * 2 * 2
    assert len({name_of(p) for p in pts}) == len(pts)
    assert {p["batching.max_tokens"] for p in pts if p["batching.method"] == "packed"} == {None, 2048, 4096, 8192}
    small = grid_points(base, native_bf16=False, supports_packing=False, fused=False, workers=0)
    assert len(small) == 1 * 10 * 2 * 1 * 1 and {p["train.precision"] for p in small} == {"fp32"}


def test_the_grid_on_the_naive_cpu_config_holds_its_112_points():
    """The grid's points come from each lever's values in levers.py: on configs/naive-cpu.yaml (batch 32 × 128 tokens)
    with native bf16, packing and fused AdamW, exactly these 112 combinations, in this order — written out here, so a
    change to a lever's values that moves the grid fails; and the search's result is read back on every lever's key
    and the schedule's."""
    from pathlib import Path

    from train.optimize.grid_space import grid_points
    from train.optimize.levers import SETTINGS_KEYS

    base = load_config(str(Path(__file__).resolve().parent.parent / "configs" / "naive-cpu.yaml"))
    batching = [(m, "bound", None) for m in ("pad-to-max", "hf-group-by-length")]
    batching += [(m, pad, t) for m, pad in (("optimal", "bound"), ("optimal", "batch-max"), ("packed", "bound"))
                 for t in (None, 2048, 4096, 8192)]
    want = [{"train.precision": p, "batching.method": m, "batching.pad_to": pad, "batching.max_tokens": t,
             "model.fast_dropout": d, "optim.fused": f, "data.num_workers": 0}
            for p in ("fp32", "bf16") for m, pad, t in batching for d in ("false", "true") for f in (False, True)]
    got = grid_points(base, native_bf16=True, supports_packing=True, fused=True, cuda=False, workers=0)
    assert len(want) == 112 and got == want
    assert SETTINGS_KEYS == ("train.precision", "batching.method", "batching.pad_to", "batching.max_tokens",
                             "model.packed_attention", "model.fast_dropout", "model.chunked_loss",
                             "memory.checkpoint_blocks", "optim.fused", "data.num_workers", "train.num_threads",
                             "compile.enabled", "compile.mode", "optim.lr", "train.max_steps", "train.eval_every",
                             "train.checkpoint_every")


def test_an_undecided_ab_gets_more_rounds_with_the_same_arms():
    from train.optimize.pairs import measure_pair

    calls = []

    def extend(result) -> bool:
        calls.append(result.rounds)
        return True

    m = measure_pair(FakeBackend(), {}, {"fake.speed": 1.5}, settings(rounds=3), 3, extend=extend)
    result, qa, qb = m.result, m.quality_best, m.quality_candidate
    assert m.horizon is None
    assert calls == [3, 6] and result.rounds == 9  # max_extensions=2: two extensions of 3 rounds
    rounds = [w.round for w in result.arms["candidate"].windows]
    assert rounds == list(range(9))
    assert len(result.ratio("candidate", "best").per_round) == 9
    # the quality verdict is read after the first 3 rounds, whatever the extensions: (1 + rounds) windows of 24
    s = settings(rounds=3)
    assert qa["samples_seen"] == qb["samples_seen"] == s.quality_samples_seen() == 96


def test_a_candidate_that_fails_the_guard_where_the_planned_run_ends_gets_no_more_rounds():
    """An undecided A/B is extended — unless the quality read past the planned run already rejects the candidate."""
    from train.optimize.pairs import measure_pair

    def run(settled: bool) -> Any:
        return measure_pair(FakeBackend(), {}, {"fake.speed": 1.5}, settings(rounds=3), 3, extend=lambda _r: True,
                            passing=24, settled=lambda h: settled and "candidate" in h)

    assert run(False).result.rounds == 9 and run(True).result.rounds == 3
    assert run(True).horizon["candidate"]["samples_seen"] >= 24


def test_settings_that_failed_the_guard_at_the_planned_run_are_not_measured_again():
    """A token budget rejected by the guard at the horizon is proposed again once a smaller budget is kept: the same
    candidate settings (its overrides replace the new best's) against a best also read there — the earlier reads
    decide, no arm is built."""
    bad = lever("big", {"fake.budget": 16, "train.max_steps": 5, "fake.speed": 2.0, "fake.harmful": True}, 1.9)
    good = lever("small", {"fake.budget": 8, "train.max_steps": 10, "fake.speed": 1.5}, 1.4)
    backend = FakeBackend()
    res = search(backend, (bad, good), {}, settings(horizon_samples=240), notice=lambda _m: None)
    assert [(d.candidate.lever, d.accepted) for d in res.decisions] == [("big", False), ("small", True),
                                                                         ("big", False)]
    first, _, again = res.decisions
    assert "(at 240 samples" in first.reason and again.seconds == 0 and again.ratio is None
    assert again.reason.startswith("quality guard, from earlier A/Bs of the same settings: held-out loss 3.0000")
    assert sum(1 for b in backend.built if b.get("fake.harmful")) == 1  # built once, in the first A/B
    # without reads at the planned run's length nothing is known: the A/B runs again
    res = search(FakeBackend(), (bad, good), {}, settings(), notice=lambda _m: None)
    assert len(res.decisions) == 3 and res.decisions[2].ratio is not None


class StepSizedBackend(FakeBackend):
    """A backend that knows each setting's samples per optimizer step (``fake.per_step``, else 8)."""

    def samples_per_step(self, settings: dict[str, Any]) -> float:
        return float(settings.get("fake.per_step", 8))


@pytest.mark.parametrize("per_step,window,before", [(8, 32, 2), (20, 80, 0), (2, 24, 3)])
def test_windows_hold_enough_steps_and_the_quality_is_read_at_the_same_samples(per_step, window, before):
    """Each window holds ``window_steps`` steps of the arm with the most samples per step (``window_samples`` at the
    least), and the quality is read after ``quality_samples_seen`` samples whatever the window (between rounds, or
    right after the warm-up when a window is longer than what is left)."""
    from train.optimize.pairs import measure_pair, quality_point, window_for

    s = settings(rounds=3, window_steps=4)  # quality after (1 + 3) x 24 = 96 samples
    backend = StepSizedBackend()
    best, cand = {"fake.per_step": 2}, {"fake.speed": 1.5, "fake.per_step": per_step}
    assert window_for(backend, (best, cand), s.window_samples, s.window_steps) == window
    warm, read_after = quality_point(s, s.rounds, window)
    assert (warm + read_after * window, read_after) == (96, before) and warm >= s.window_samples
    m = measure_pair(backend, best, cand, s, s.rounds)
    assert m.quality_best["samples_seen"] == m.quality_candidate["samples_seen"] == s.quality_samples_seen() == 96
    assert all(w.counts["samples"] >= window for a in m.result.arms.values() for w in a.windows)
    assert window_for(FakeBackend(), ({}, cand), 24, 4) == 24, "no samples per step known: window_samples"
    assert window_for(backend, ({}, {"fake.per_step": 50}), 24, 4, at_most=120) == 120, "capped by the planned run"
    assert window_for(backend, ({}, {"fake.per_step": 50}), 24, 4, at_most=10) == 24, "window_samples at the least"
    assert SearchSettings.from_config(RunConfig().optimize, 6000).max_window_samples == 1200


def test_the_final_confirmation_times_windows_of_window_samples():
    """The baseline runs every window's samples too (often ten times slower per sample): the confirmation's windows
    are not sized in the optimized arm's steps."""
    from train.optimize.search import confirm

    s = settings(rounds=3, window_steps=4, confirm_rounds=2)
    out = confirm(StepSizedBackend(), {}, {"fake.per_step": 50, "fake.speed": 2.0}, s, notice=lambda _m: None)
    assert {w["samples"] for arm in out["ab"]["arms"].values() for w in arm["windows"]} == {24}


def test_the_grid_holds_a_token_budget_to_the_same_combination_at_the_batch_size():
    from train.optimize.grid_screen import quality_guard
    from train.optimize.grid_space import name_of

    def point(budget):
        return {"train.precision": "bf16", "batching.method": "optimal", "batching.pad_to": "bound",
                "batching.max_tokens": budget, "model.fast_dropout": "false", "optim.fused": False,
                "data.num_workers": 0}

    named = {name_of(point(b)): point(b) for b in (None, 4096)} | {"baseline": {}}
    twin, big = name_of(point(None)), name_of(point(4096))
    # the budget learns as well as the config as given, not as well as its own batch-size twin: the search rejects it
    q = {"baseline": {"loss": 3.2}, twin: {"loss": 2.65}, big: {"loss": 3.1}}
    g = quality_guard(named, q, 0.05)
    assert g[twin]["passes"] and g["baseline"]["passes"] and not g[big]["passes"]
    assert f"({twin} (the combination it grows from)'s 2.6500 + 5%)" in g[big]["why"]
    g = quality_guard(named, {**q, big: {"loss": 2.7}}, 0.05)
    assert g[big]["passes"]
    g = quality_guard(named, {**q, twin: {"loss": 3.5}, big: {"loss": 3.5}}, 0.05)  # the twin itself learns worse
    assert not g[big]["passes"]
    assert g[big]["why"].startswith(f"grown from {twin}, which learns worse: held-out loss 3.5")


def test_the_grid_judges_other_steps_per_sample_late_in_the_run_against_the_combination_they_grow_from():
    """Packed rows and token budgets take other samples per optimizer step (their schedule's train.max_steps): judged
    as the search judges them, after the planned run's horizon, both the arm and its twin trained on — on demand,
    only for the arms asked about; an arm on the config's steps is judged early against the config as given."""
    from train.optimize.grid_screen import quality_guard
    from train.optimize.grid_space import name_of, twin_of

    def point(method, budget, steps=None):
        return {"train.precision": "bf16", "batching.method": method, "batching.pad_to": "bound",
                "batching.max_tokens": budget, "model.fast_dropout": "false", "optim.fused": False,
                "data.num_workers": 0, **({"train.max_steps": steps} if steps else {})}

    pts = [point("optimal", None), point("optimal", 4096, 150), point("packed", None, 300), point("packed", 4096, 140)]
    named = {name_of(p): p for p in pts} | {"baseline": {}}
    fitted, budget, packed, packed_budget = (name_of(p) for p in pts)
    assert twin_of(named, budget) == fitted and twin_of(named, packed) == fitted
    assert twin_of(named, packed_budget) == packed and twin_of(named, fitted) is None
    early = {"baseline": {"loss": 3.0}, fitted: {"loss": 2.9}, budget: {"loss": 3.5}, packed: {"loss": 3.4},
             packed_budget: {"loss": 3.6}}
    late = {fitted: {"loss": 2.0, "samples_seen": 600}, budget: {"loss": 2.05, "samples_seen": 600},
            packed: {"loss": 2.02, "samples_seen": 600}, packed_budget: {"loss": 2.5, "samples_seen": 600}}
    asked: list[str] = []

    def at_horizon(name):
        asked.append(name)
        return late[name]

    g = quality_guard(named, early, 0.05, at_horizon, names=[budget], base_steps=600)
    assert list(g) == [budget] and g[budget]["passes"] and sorted(asked) == sorted([fitted, budget])
    assert "(at 600 samples: other steps per sample, judged late in the run)" in g[budget]["why"]
    g = quality_guard(named, early, 0.05, at_horizon, base_steps=600)
    assert g[fitted]["passes"] and "late" not in g[fitted]["why"]  # the config's steps: early, vs the config
    assert g[packed]["passes"] and not g[packed_budget]["passes"]  # 2.5 > packed's 2.02 + 5%
    g = quality_guard(named, early, 0.05, base_steps=600)  # no horizon: everything early
    assert not g[budget]["passes"] and not g[packed]["passes"]


def test_the_grid_picks_its_best_from_the_final_stage_and_judges_the_search(monkeypatch, tiny_cfg, tmp_path):
    """A combination that is lucky in the screening's few windows (fast only at first) must not be called the best:
    the finalists are re-measured against each other; a combination that learns worse (the quality guard against
    the config as given) is no finalist however fast; the search's result is judged against the final's best."""
    from train.config import dump_config
    from train.optimize import grid as grid_mod
    from train.optimize import grid_final as final_mod
    from train.optimize import isolated as isolated_mod

    rates = {"lucky": (400.0, 100.0), "steady": (150.0, 150.0), "slow": (90.0, 90.0), "optimized": (147.0, 147.0),
             "harmful": (900.0, 900.0), "baseline": (50.0, 50.0)}
    losses = {"harmful": 9.0, "slow": 2.05}

    windows: dict[str, float] = {}  # per configuration, across its handles: the lucky one is fast only at first
    built: list[str] = []
    alive: set[int] = set()

    class Handle:
        def __init__(self, name: str) -> None:
            self.name, (self.fast, self.slow) = name, rates[name]
            self.windows = 0.0
            built.append(name)
            alive.add(id(self))
            self.alive_when_built = len(alive)

        def warmup(self, samples: int) -> float:
            return 0.0

        def step(self) -> dict:
            self.windows += 1 / 4  # a window of 32 samples is 4 steps of 8
            windows[self.name] = windows.get(self.name, 0.0) + 1 / 4
            rate = self.fast if windows[self.name] <= 3 else self.slow  # lucky: fast for the screening's 3 windows
            return {"samples": 8, "seconds": 8 / rate}

        def quality(self) -> dict:
            return {"loss": losses.get(self.name, 2.0), "nonfinite_steps": 0, "samples_seen": 32 * (1 + self.windows)}

        def close(self) -> None:
            alive.discard(id(self))

    class Backend:
        def __init__(self, *_a, **_k) -> None:
            pass

        def context(self, _settings):
            return LeverContext(cfg=None, device_type="cpu")

        def schedule(self, _settings):
            return {}

        def planned_samples(self):
            return 10_000  # every fake combination on the config's steps: judged early, nothing trained on

        def samples_per_step(self, point):
            return 16.0 if point.get("label") == "steady" else 8.0

        def arm(self, name: str, point: dict) -> Handle:
            h = Handle(name if name in ("optimized", "baseline") else point["label"])
            handles.append(h)
            return h

    handles: list[Handle] = []

    points = [{"train.precision": "fp32", "batching.method": m, "batching.max_tokens": None,
               "model.fast_dropout": "false", "optim.fused": False, "data.num_workers": 0, "label": label}
              for m, label in (("pad-to-max", "slow"), ("optimal", "lucky"), ("hf-group-by-length", "steady"),
                               ("packed", "harmful"))]
    fresh_calls: list[dict] = []

    def in_a_fresh_process(config_path, arms, *, rounds, window_samples, warmup_samples, work_dir, timeout_s):
        """Stands in for the child process: the fake backend's handles, built only for this A/B."""
        from train.perf.ab import Arm, interleave

        assert load_config(str(config_path)).train.run_id == "t"  # the grid's own resolved config
        fresh_calls.append({"arms": list(arms), "rounds": rounds, "work_dir": work_dir, "window": window_samples})
        if "slow" in [a.get("label") for a in arms.values()]:
            raise isolated_mod.IsolatedFailure(f"{work_dir / 'child.log'}: exit code 1: it broke")
        hs = {n: Backend().arm(n, s) for n, s in arms.items()}
        try:
            return interleave([Arm(n, h.step) for n, h in hs.items()], rounds=rounds, window_samples=window_samples,
                              warmup=0, device=torch.device("cpu"))
        finally:
            for h in hs.values():
                h.close()

    monkeypatch.setattr(grid_mod, "RunBackend", Backend)
    monkeypatch.setattr(grid_mod, "grid_points", lambda *a, **k: points)
    monkeypatch.setattr(final_mod, "measure_in_fresh_process", in_a_fresh_process)
    cfg = tiny_cfg("optimize.window_samples=32", "optimize.grid_rounds=3", "optimize.grid_finalists=3",
                   "optimize.confirm_rounds=4", "optimize.recheck_rounds=6")
    opt_dir = tmp_path / "opt"
    opt_dir.mkdir()
    (opt_dir / "optimized.yaml").write_text(dump_config(cfg))
    (opt_dir / "optimize.json").write_text(json.dumps({"seconds": 3.0}))
    g = grid_mod.run_grid(cfg, str(opt_dir / "optimized.yaml"), notice=lambda _m: None)
    screening = [r["name"] for r in g["screening"]["rows"]]
    assert screening[0].startswith("fp32/packed/") and screening[1].startswith("fp32/optimal/")  # harmful, lucky
    assert g["rejected_by_quality_guard"] == [screening[0]] and g["fastest_of_the_screening"] == screening[0]
    assert g["best"].startswith("fp32/hf-group-by-length/")  # the final says otherwise than the screening
    # every verdict after the samples the search's are taken after: (1 + optimize.rounds) windows, not the screening's
    assert g["quality_samples_seen"] == (1 + cfg.optimize.rounds) * 32 > (1 + 3) * 32
    assert all(r["quality"]["samples_seen"] >= g["quality_samples_seen"] for r in g["screening"]["rows"])
    # the final: the search's result against each of the 2 finalists alone (two arms interleaved, its own A/B)
    assert [r["name"] for r in g["final"]["rows"]][0] == g["best"] and len(g["final"]["rows"]) == 2
    assert g["final"]["paired_with_optimized"]
    assert all(r["vs_optimized"]["b"] == "optimized" for r in g["final"]["rows"])
    assert not any(r["name"].startswith("fp32/packed/") for r in g["final"]["rows"])
    # the final's arms are fresh, two alive at a time (the screening's 6 closed first), and closed after
    final_handles = handles[6:]
    assert [h.name for h in final_handles] == ["optimized", "lucky", "optimized", "steady", "optimized", "steady"]
    assert [h.alive_when_built for h in final_handles] == [1, 2, 1, 2, 1, 2] and not alive
    # ... each pair in its own (fake) fresh process and work directory; a pair whose process fails is not measured;
    # the best is measured once more against the search's result after it was picked (the last call)
    # (the re-check over optimize.recheck_rounds: its interval is the verdict's)
    assert [c["arms"][0] for c in fresh_calls] == ["optimized"] * 4
    assert [c["rounds"] for c in fresh_calls] == [4, 4, 4, 6]
    assert len({c["work_dir"] for c in fresh_calls}) == 4 and fresh_calls[-1]["work_dir"].name == "recheck"
    # each window holds FINAL_WINDOW_STEPS steps of the pair's arm with the most samples per step (16 for steady)
    assert [c["window"] for c in fresh_calls] == [16 * 8, 16 * 16, 16 * 8, 16 * 16]
    slow = next(n for n in screening if n.startswith("fp32/pad-to-max/"))
    assert list(g["final"]["failed"]) == [slow] and "it broke" in g["final"]["failed"][slow]
    o = g["optimized"]
    assert o["vs_best"]["median"] == pytest.approx(147 / 150) and o["share_verdict"] == "reached"
    assert o["vs_best_source"] == "recheck" and o["vs_best_at_selection"]["median"] == pytest.approx(147 / 150)
    assert o["search_seconds"] == 3.0 and o["search_share_of_grid_time"] == pytest.approx(3.0 / g["seconds"])
    assert o["quality_guard"]["passes"] and g["quality_reference"]["loss"] == 2.0
    md = (tmp_path / "runs" / "t" / "optimize-grid" / "grid.md").read_text()
    assert "in one more fresh A/B after the pick" in md
    assert "**reached**" in md and "## Final: the search's result against each of 2 finalists, two arms" in md
    assert "**fails**: held-out loss 9.0000" in md and "1 combination(s) learn worse" in md
    assert f"- {slow}: not measured (" in md and "Each A/B of the final ran in a new process" in md


def test_the_search_is_judged_against_the_grids_best_on_windows_its_pick_never_saw(tmp_path):
    """The grid's best is the largest of several noisy paired ratios, so the A/B it was picked on flatters it (the
    winner's curse): the search's result is judged on the re-check, an A/B measured after the pick; without one, on
    the selection, and said so."""
    from train.optimize.grid_report import optimized_vs_best, render
    from train.perf.ab import ABResult, ArmResult, Window

    def ab(optimized: list[float], best: list[float]) -> ABResult:
        arms = {n: ArmResult(n, [Window(i, 1.0, 4, {"samples": r}) for i, r in enumerate(rates)])
                for n, rates in (("optimized", optimized), ("best", best))}
        return ABResult(arms=arms, rounds=len(optimized), load_start=None, load_end=None)

    lucky = ab([100.0, 101, 99, 100, 100, 102, 98, 100], [120.0, 122, 119, 121, 120, 118, 121, 120])  # 0.83x
    again = ab([100.0, 101, 99, 100, 100, 102, 98, 100], [100.0, 100, 100, 101, 99, 100, 100, 100])  # 1.0x
    (tmp_path / "optimize.json").write_text(json.dumps({"seconds": 30.0}))
    path = str(tmp_path / "optimized.yaml")
    o = optimized_vs_best(path, {}, lucky, "best", 100.0, 300.0, recheck=again)
    assert o["vs_best_source"] == "recheck" and o["share_verdict"] == "reached"
    assert o["vs_best"]["median"] == pytest.approx(1.0) and o["vs_best_at_selection"]["median"] < 0.85
    o = optimized_vs_best(path, {}, lucky, "best", 100.0, 300.0, recheck_failed="child.log: exit code 1")
    assert o["vs_best_source"] == "selection" and o["share_verdict"] == "not reached"
    g = {"points": 2, "seconds": 300.0, "device": "cpu", "load_1min": [0, 0], "best": "best",
         "best_samples_per_s": 120.0, "optimized": o, "quality_reference": {"loss": 2.0}, "quality_tolerance": 0.05,
         "fastest_of_the_screening": "best", "rejected_by_quality_guard": [],
         "final": {"rows": [], "paired_with_optimized": True, "rounds": 8, "seconds": 10.0},
         "screening": {"rows": [], "rounds": 3, "seconds": 100.0}, "left_out": {}}
    assert "the re-check failed: child.log: exit code 1" in render(g)


def test_arms_are_compared_by_real_tokens_per_second_where_they_count_them():
    """A window that ends at a sample count favours an arm whose windows came out of short samples; the real tokens
    are the work: an arm as fast per step with 8 samples of 10 tokens against 8 of 20 is no faster."""
    from train.optimize.judging import throughput_metric
    from train.perf.ab import ABResult, ArmResult, Window

    res = search(FakeBackend(), (lever("short", {"fake.tokens_per_sample": 10}, 1.9),),
                 {"fake.tokens_per_sample": 20}, settings(), notice=lambda _m: None)
    d = res.decisions[0]
    assert d.ratio["metric"] == "real_tokens" and d.ratio["high"] < 1.0 and not d.accepted
    counted = ABResult({"a": ArmResult("a", [Window(0, 1.0, 1, {"samples": 8})])}, 1, None, None)
    assert throughput_metric(counted) == "samples"


def test_a_lever_that_changes_the_steps_per_sample_is_judged_where_the_planned_run_ends():
    """A token budget takes fewer, larger steps: behind early in training, as good by the run's end. Its quality
    verdict is taken after optimize.horizon_fraction of the planned samples (both arms trained on, untimed); a lever
    with the same steps per sample is judged early; without a planned length the early verdict stands, and says so."""
    late = lever("budget", {"fake.speed": 2.0, "fake.learns_late": 200, "train.max_steps": 5}, 1.9)
    backend = FakeBackend()
    res = search(backend, (late,), {}, settings(horizon_samples=240), notice=lambda _m: None)
    d = res.decisions[0]
    assert d.accepted and d.quality["candidate"]["loss"] == 1.5  # behind after (1 + rounds) windows
    h = d.quality["horizon"]
    assert h["samples"] == 240 and h["candidate"]["loss"] == 1.0 and h["candidate"]["samples_seen"] >= 240
    assert h["best"]["samples_seen"] >= 240 and "(at 240 samples: the planned run)" in d.reason
    res = search(FakeBackend(), (late,), {}, settings(), notice=lambda _m: None)  # no planned run length
    d = res.decisions[0]
    assert not d.accepted and "horizon" not in d.quality
    assert d.reason.startswith("quality guard: held-out loss 1.5000") and "(early: no planned run length" in d.reason
    same_steps = lever("drop", {"fake.speed": 2.0, "fake.learns_late": 200}, 1.9)
    res = search(FakeBackend(), (same_steps,), {}, settings(horizon_samples=240), notice=lambda _m: None)
    assert not res.decisions[0].accepted and "horizon" not in res.decisions[0].quality
    assert "early" not in res.decisions[0].reason  # judged at equal steps: no horizon to wait for


def test_a_run_counted_in_epochs_judges_other_steps_per_sample_at_the_horizon_too():
    """With ``train.epochs`` no step-counted setting changes (train.max_steps is null), so the backend's samples per
    optimizer step say which candidate takes fewer, larger steps: it is judged at the horizon all the same."""

    class PerStep(FakeBackend):
        def samples_per_step(self, settings):
            return 32.0 * settings.get("fake.budget", 1)

    budget = lever("budget", {"fake.speed": 2.0, "fake.learns_late": 200, "fake.budget": 4}, 1.9)
    res = search(PerStep(), (budget,), {}, settings(horizon_samples=240), notice=lambda _m: None)
    d = res.decisions[0]
    assert d.candidate.other_steps and d.accepted and d.quality["horizon"]["samples"] == 240
    res = search(FakeBackend(), (budget,), {}, settings(horizon_samples=240), notice=lambda _m: None)
    assert not res.decisions[0].accepted  # without samples per step: judged early, behind


def test_a_planned_run_shorter_than_the_ab_is_judged_where_the_ab_passes_it():
    """One epoch of a small split can be shorter than the A/B itself (long windows of large steps): the arms pass the
    horizon while timed, so both qualities are read at the first round boundary past it — not left at the early
    verdict ("the arms have seen N samples")."""

    class PerStep(FakeBackend):
        def samples_per_step(self, settings):
            return 8.0 * settings.get("fake.budget", 1)

    # windows of 4 steps x 24 samples: the quality point (96) right after the warm-up, the horizon (150) inside round 0
    budget = lever("budget", {"fake.speed": 2.0, "fake.learns_late": 100, "fake.budget": 3}, 1.9)
    res = search(PerStep(), (budget,), {}, settings(rounds=3, window_steps=4, horizon_samples=150),
                 notice=lambda _m: None)
    d = res.decisions[0]
    assert d.quality["candidate"]["loss"] == 1.5 and d.quality["candidate"]["samples_seen"] == 96  # early: behind
    h = d.quality["horizon"]
    assert d.accepted and h["candidate"]["loss"] == 1.0 and h["samples"] == 192  # 96 + one window of 96
    assert h["best"]["samples_seen"] == h["candidate"]["samples_seen"] == 192
    assert "the first read past the planned run's 150 samples" in d.reason


def test_the_horizon_shrinks_to_what_fits_the_time_left():
    from train.optimize.pairs import horizon_target
    from train.perf.ab import ABResult, ArmResult, Window

    res = ABResult({"best": ArmResult("best", [Window(0, 1.0, 1, {"samples": 100})]),
                    "candidate": ArmResult("candidate", [Window(0, 1.0, 1, {"samples": 50})])}, 1, None, None)
    seen = {"best": 96, "candidate": 100}
    assert horizon_target(res, seen, 150, 100.0, 24) == (150, "")
    assert horizon_target(res, seen, 1000, 3.0, 24) == (200, "200 of the planned 1000 samples: what fit the time left")
    assert horizon_target(res, seen, 1000, 0.5, 24)[0] is None  # 16 more samples: less than a window
    assert horizon_target(res, seen, 90, 100.0, 24) == (None, "the arms have seen 100 samples, the horizon's 90")
    assert horizon_target(res, seen, None, 100.0, 24)[0] is None


def test_grid_final_of_several_finalists_gets_their_time(monkeypatch, tmp_path):
    """``optimize.arm_timeout_s`` bounds an A/B of two arms: the final of four finalists in one process (no
    ``--optimized``) gets twice that, a pair with ``optimized`` exactly that; a final that fails everywhere is a
    UserError naming the child's log."""
    from types import SimpleNamespace

    from train.errors import UserError
    from train.optimize import grid_final as final_mod
    from train.optimize.grid_screen import Rates
    from train.optimize.isolated import IsolatedFailure

    seen: list[tuple[int, float]] = []

    def refuse(config_path, arms, *, rounds, window_samples, warmup_samples, work_dir, timeout_s):
        seen.append((len(arms), timeout_s))
        raise IsolatedFailure(f"{work_dir / 'child.log'}: ran past {timeout_s:.0f} s")

    monkeypatch.setattr(final_mod, "measure_in_fresh_process", refuse)
    o = SimpleNamespace(window_samples=32, confirm_rounds=2, recheck_rounds=2, arm_timeout_s=600.0)
    bar = SimpleNamespace(update=lambda n: None)
    names = ["a", "b", "c", "d"]
    with pytest.raises(UserError, match="child.log: ran past 1200 s"):
        final_mod.run_final(tmp_path / "config.yaml", object(), {n: {} for n in names}, names, o, tmp_path,
                            Rates("samples", 1.0), bar, notice=lambda _m: None)
    with pytest.raises(UserError):
        final_mod.run_final(tmp_path / "config.yaml", object(), {n: {} for n in ["optimized", *names]}, names[:2],
                            o, tmp_path, Rates("samples", 1.0), bar, notice=lambda _m: None)
    assert seen == [(4, 1200.0), (2, 600.0), (2, 600.0)]
