"""The step timer's CUDA branch (timing events read at log time) exercised on a CPU with a fake event class,
and the training loop's steady steps reading nothing back from the device."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import CPU, HostReads, small_trainer
from train.callbacks import Callback
from train.compat import fused_adamw_supported
from train.perf.timer import StepTimer


class FakeClock:
    """A device stream: ``now`` (ms) advances by hand; events record it in order; a wait on one event
    completes it and every event recorded before it (counted in ``syncs``)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.syncs = 0
        self.recorded = 0
        self.completed = 0

    def event(self) -> "FakeEvent":
        return FakeEvent(self)


class FakeEvent:
    """``torch.cuda.Event(enable_timing=True)``'s interface; reading a time before the event completed is an
    error, as on CUDA."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock, self.t, self.seq = clock, None, None

    def record(self) -> None:
        self.clock.recorded += 1
        self.t, self.seq = self.clock.now, self.clock.recorded

    def synchronize(self) -> None:
        self.clock.syncs += 1
        self.clock.completed = max(self.clock.completed, self.seq)

    def elapsed_time(self, end: "FakeEvent") -> float:
        if max(self.seq, end.seq) > self.clock.completed:
            raise RuntimeError("event not completed: elapsed_time before a sync")
        return end.t - self.t


def test_event_timer_reads_durations_only_on_flush() -> None:
    clock = FakeClock()
    timer = StepTimer(torch.device("cuda"), event_factory=clock.event)
    assert timer.uses_events
    for ms in (50.0, 10.0, 12.0):
        timer.start()
        clock.now += ms
        assert timer.stop() is None  # not known without waiting for the device
    assert clock.syncs == 0 and timer.pending == 3 and timer.first_ms is None
    assert timer.flush() == [50.0, 10.0, 12.0]
    assert clock.syncs == 1  # one wait for the newest event covers every earlier one
    assert timer.first_ms == 50.0 and timer.steady_ms == [10.0, 12.0]
    assert timer.flush() == [] and clock.syncs == 1  # nothing pending: no sync


def test_event_timer_resolve_reads_the_step_now() -> None:
    clock = FakeClock()
    timer = StepTimer(torch.device("cuda"), event_factory=clock.event)
    timer.start()
    clock.now += 7.0
    timer.stop()
    timer.start()
    clock.now += 3.0
    assert timer.stop(resolve=True) == 3.0 and clock.syncs == 1
    assert timer.flush() == [7.0, 3.0] and clock.syncs == 1  # both already read, returned once
    assert timer.summary()["p50"] == 3.0


def test_host_clock_timer_and_errors() -> None:
    times = iter([1.0, 1.5, 2.0, 2.25])
    timer = StepTimer(torch.device("cpu"), clock=lambda: next(times))
    assert not timer.uses_events
    timer.start()
    assert timer.stop() == 500.0
    timer.start()
    assert timer.stop() == 250.0
    assert timer.flush() == [500.0, 250.0] and timer.flush() == []
    with pytest.raises(RuntimeError):
        timer.stop()


class _Loader:
    """A train loader stand-in: fixed batches, ``batch_sampler.set_epoch``."""

    class _Sampler:
        def set_epoch(self, epoch: int) -> None:
            pass

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.batches = [{"input_ids": torch.randint(0, 50, (4, 16), generator=g),
                         "attention_mask": torch.ones(4, 16, dtype=torch.bool),
                         "labels": torch.randint(0, 5, (4,), generator=g), "real_tokens": 64, "truncated": 0}
                        for _ in range(n)]
        self.batch_sampler = self._Sampler()

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        return iter(self.batches)


class _Probe(Callback):
    """Per step: device syncs and host reads so far, and the step_ms the loop passed."""

    def __init__(self, clock: FakeClock, reads: HostReads, needs: bool = False) -> None:
        self.clock, self.reads, self.needs_step_ms = clock, reads, needs
        self.seen: list[tuple[int, int, int, object]] = []

    def on_step_end(self, step: int, step_ms):
        self.seen.append((step, self.clock.syncs, len(self.reads.names), step_ms))
        return False


def _fit_with_fake_events(needs_step_ms: bool):
    tr = small_trainer("train.max_steps=12", "train.log_every=5", "train.progress=false")
    tr.train_loader = _Loader(12)
    clock = FakeClock()
    tr.timer = StepTimer(torch.device("cuda"), event_factory=clock.event)  # the CUDA branch, on a CPU
    real_forward = tr.train_model

    def forward(*a, **k):
        clock.now += 10.0  # every step takes 10 ms of "device" time (inside the timed step)
        return real_forward(*a, **k)

    tr.train_model = forward
    with HostReads() as reads:
        probe = _Probe(clock, reads, needs_step_ms)
        tr.add_callback(probe)
        records = []
        tr.logger = type("L", (), {"log": lambda self, r: records.append(r)})()
        tr.fit()
    return tr, probe, records, clock


def test_steady_steps_never_wait_for_the_device() -> None:
    tr, probe, records, clock = _fit_with_fake_events(needs_step_ms=False)
    syncs = {step: s for step, s, _, _ in probe.seen}
    new_syncs = {step: syncs[step] - syncs.get(step - 1, 0) for step in syncs}
    # step 1 (time to first step) and the logged steps 5, 10, 12 (the last) read the events; no other step does
    assert {step for step, n in new_syncs.items() if n} == {1, 5, 10, 12}
    assert clock.syncs == 4
    assert [r["step"] for r in records] == [5, 10, 12]
    assert [r["step_time_ms"] for r in records] == pytest.approx([10.0, 10.0, 10.0])
    assert [ms for *_, ms in probe.seen] == [10.0] + [None] * 11  # on CUDA the host does not know them
    assert tr.timer.first_ms == 10.0 and len(tr.timer.steady_ms) == 11
    if fused_adamw_supported(CPU):  # torch < 2.4: the non-fused optimizer's step decision reads `ok` on the host
        reads = {step: r for step, _, r, _ in probe.seen}
        steady_reads = {step: reads[step] - reads[step - 1] for step in reads if step > 1 and step not in (5, 10, 12)}
        assert all(n == 0 for n in steady_reads.values()), steady_reads


def test_a_callback_that_needs_step_times_gets_them() -> None:
    _, probe, records, clock = _fit_with_fake_events(needs_step_ms=True)
    assert [ms for *_, ms in probe.seen] == [10.0] * 12
    assert clock.syncs == 12 and [r["step_time_ms"] for r in records] == pytest.approx([10.0] * 3)


@pytest.mark.skipif(not fused_adamw_supported(CPU),
                    reason="torch < 2.4: the non-fused optimizer reads `ok` on the host")
def test_sync_audit_passes_the_loop_and_catches_a_host_read(tiny_cfg, monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from train.perf.host_syncs import SyncAudit
    from train.run.training import run_training
    cfg = ["train.max_steps=8", "train.log_every=4", "train.eval_every=100"]
    audit = SyncAudit()
    report = run_training(tiny_cfg(*cfg), t_start=time.perf_counter(), hooks=(audit,))
    r = report["sync_audit"]
    assert r["watched_steps"] == 5 and r["host_syncs"] == 0 and r["passed"], r  # steps 2, 3, 5, 6, 7
    from train.numerics import NumericsGuard

    real = NumericsGuard.observe

    def observe(self, loss, clip):  # a step that reads its loss back: the audit must see it
        float(loss)
        return real(self, loss, clip)

    monkeypatch.setattr(NumericsGuard, "observe", observe)
    audit = SyncAudit()
    r = run_training(tiny_cfg(*cfg, "train.run_id=t2"), t_start=time.perf_counter(), hooks=(audit,))["sync_audit"]
    assert r["host_syncs"] == 5 and not r["passed"]
    assert r["first_syncs"][0]["step"] == 2 and r["first_syncs"][0]["what"] == "__float__" and any(
        f.startswith("trainer.py:") and f.endswith(" step") for f in r["first_syncs"][0]["stack"]), r


def test_the_sync_debug_modes_own_notice_is_not_counted_as_a_host_sync() -> None:
    """torch says "Synchronization debug mode is a prototype feature …" once, when the audit turns the mode on; only
    its "called a synchronizing CUDA operation" warnings are syncs (the H200 run counted the notice as one)."""
    from train.perf.host_syncs import SyncAudit

    audit = SyncAudit()
    audit._showwarning = lambda *a, **k: None
    audit._cuda_warning(UserWarning("Synchronization debug mode is a prototype feature and does not yet detect all "
                                    "synchronizing operations (Triggered internally at Module.cpp:1003.)"),
                        UserWarning, "trainer.py", 1)
    assert audit.host_syncs == 0
    audit._cuda_warning(UserWarning("called a synchronizing CUDA operation"), UserWarning, "trainer.py", 2)
    assert audit.host_syncs == 1
