"""The real arms of ``make optimize``: each candidate is the user's config with the search's overrides, built by the
one set-up (:func:`train.setup.build_run`) and stepped by ``make train``'s own :meth:`~train.trainer.Trainer.step`;
each profile is the same torch.profiler window and attribution as ``make profile``."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch

from train.compat import fused_adamw_supported
from train.compiling.warmup import warm_up_for_run
from train.config import RunConfig
from train.data import make_loader
from train.data.layout_cost import layout_cost
from train.evaluation import evaluate
from train.optimize.deadline import Deadline, OutOfTime, budget_reason
from train.optimize.levers import BATCHING, batching_settings
from train.optimize.preflight import Capabilities, model_capabilities
from train.optimize.proposals import Evidence, LeverContext
from train.optimize.schedule import SCHEDULE_KEYS, schedule_in_samples
from train.precision import PrecisionPolicy, cpu_native_bf16
from train.profiling.attribution import COMPUTE, LAUNCH, MEMORY, build_summary
from train.profiling.roofline import ridge_point
from train.profiling.session import write_summary
from train.profiling.window import TorchProfileWindow
from train.setup import build_model, build_run, replan
from train.tools.env import device_name

DROPOUT_MASK_OPS = ("aten::bernoulli_", "aten::bernoulli", "aten::native_dropout", "aten::dropout", "aten::rand",
                    "aten::uniform_", "aten::ge", "aten::native_dropout_backward")
"""Ops whose share of the step is the dropout-mask evidence (nn.Dropout's mask and FastDropout's)."""

ATTENTION_OPS = ("aten::bmm", "aten::baddbmm", "aten::_softmax", "aten::_softmax_backward_data",
                 "aten::_masked_softmax", "aten::_masked_softmax_backward")
"""Ops of the eager attention (scores and weighted sum: the encoders' linear layers run ``mm``/``addmm``); fused
attention kernels are matched by name (``scaled_dot_product``, ``flash_attention``, ``efficient_attention``), and any
op on a [..., S, S] tensor of 3 or more dimensions (the masks, dropout on the probabilities) counts too."""


def is_attention_op(name: str, input_shapes: list) -> bool:
    """True for an op of the attention's S × S work (:data:`ATTENTION_OPS`)."""
    if name in ATTENTION_OPS or any(k in name for k in ("scaled_dot_product", "flash_attention",
                                                        "efficient_attention")):
        return True
    return any(isinstance(s, (list, tuple)) and len(s) >= 3 and s[-1] == s[-2] and s[-1] > 1 for s in input_shapes)


def torch_rng(device: torch.device) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The torch generators a training step draws from (dropout masks): the CPU's and ``device``'s when CUDA."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def set_torch_rng(state: tuple[torch.Tensor, Optional[torch.Tensor]], device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


class RunArm:
    """One configuration as a real training run (see :class:`~train.optimize.arms.ArmHandle`).

    Each arm draws its random numbers (dropout masks) from a stream of its own, taken right after :func:`build_run`
    seeded it: arms of one model start from the same stream, and what one arm draws never shifts another's, however
    the A/B interleaves them — common random numbers, the variance reduction of simulation comparisons (Law, *Simulation
    Modeling and Analysis*, 5th ed., 2015, §11.2): on one shared stream the same config's held-out loss can differ
    between two A/Bs by as much as the quality guard's tolerance (docs/optimize.md, "The quality guard")."""

    def __init__(self, backend: "RunBackend", cfg: RunConfig) -> None:
        self.backend, self.cfg = backend, cfg
        self.threads = cfg.train.num_threads or backend.default_threads
        torch.set_num_threads(self.threads)
        self.run = build_run(cfg, replan(cfg, backend.bundle), backend.device, backend.policy(cfg),
                             compile=cfg.compile.enabled == "true")
        self.rng = torch_rng(backend.device)

    def warmup(self, samples: int) -> float:
        one_off = 0.0
        compiled = self.run.compiled
        if compiled is not None and compiled.enabled:
            t0 = time.perf_counter()
            warm_up_for_run(compiled, self.run.trainer, self.run.model, None, force=True, notice=lambda _m: None)
            one_off = time.perf_counter() - t0
        seen = 0
        while seen < samples:
            seen += self.step()["samples"]
        return one_off

    def step(self) -> dict[str, float]:
        if torch.get_num_threads() != self.threads:  # process-wide: each arm sets its own before its step
            torch.set_num_threads(self.threads)
        device = self.backend.device
        set_torch_rng(self.rng, device)  # this arm's own stream (class docstring)
        counts = self.run.trainer.step().counts()
        self.rng = torch_rng(device)
        return counts

    def quality(self) -> dict[str, Any]:
        t = self.run.trainer
        t.guard.end_window(max(1, t.window["steps"]))  # one sync: the non-finite steps so far
        ev = evaluate(self.run.model, self.backend.quality_batches(), self.run.policy, self.backend.bundle.num_classes,
                      self.backend.device)
        return {"loss": ev["loss"], "accuracy": ev["accuracy"], "held_out_samples": ev["samples"],
                "samples_seen": t.stats.samples, "nonfinite_steps": t.guard.skipped_steps}

    def close(self) -> None:
        torch.set_num_threads(self.backend.default_threads)
        self.run = None


class RunBackend:
    """Builds arms and profiles from ``base`` (the user's resolved config) + the search's overrides, on the prepared
    ``bundle``. Profiles are written to ``out_dir/profiles/<n>/summary.{json,md}``."""

    def __init__(self, base: RunConfig, bundle: Any, device: torch.device, out_dir: Path,
                 notice: Callable[[str], None] = print, deadline: Optional[Deadline] = None,
                 capabilities: Optional[Capabilities] = None) -> None:
        self.base, self.bundle, self.device, self.out_dir, self.notice = base, bundle, device, out_dir, notice
        self.deadline = deadline
        self.default_threads = torch.get_num_threads()
        self._policies: dict[str, PrecisionPolicy] = {}
        self._quality: Optional[list[dict]] = None
        self._caps = capabilities  # the command's, where it built the model already
        self._roofline: dict[str, dict] = {}
        self._costs: dict[str, Any] = {}
        b = base.batching
        self.base_budget = b.max_tokens or b.batch_size * base.data.max_len

    def cfg(self, settings: dict[str, Any]) -> RunConfig:
        return self.base.with_values(settings, "optimize candidate")

    def policy(self, cfg: RunConfig) -> PrecisionPolicy:
        mode = cfg.train.precision
        if mode not in self._policies:
            self._policies[mode] = PrecisionPolicy.for_config(cfg, self.device)
        return self._policies[mode]

    def quality_batches(self) -> list[dict]:
        """The fixed held-out slice: the first ``optimize.quality_samples`` samples of the validation split (else the
        test split) in fitted-bucket evaluation batches — the same batches for every arm."""
        if self._quality is None:
            split = "validation" if len(self.bundle.splits["validation"]) else "test"
            # fitted buckets, whatever the baseline's batching: less padding to evaluate, the same batches for all
            cfg = self.base.with_values({"batching.method": "optimal", "batching.max_tokens": None})
            loader = make_loader(replan(cfg, self.bundle), split, cfg, train=False, device=self.device)
            out, n = [], 0
            for batch in loader:
                out.append(batch)
                n += int(batch.get("samples", batch["labels"].numel()))
                if n >= self.base.optimize.quality_samples:
                    break
            self._quality = out
        return self._quality

    def _capabilities(self) -> Capabilities:
        if self._caps is None:
            self._caps = model_capabilities(build_model(self.base, self.bundle), self.device)
        return self._caps

    def arm(self, name: str, settings: dict[str, Any]) -> RunArm:
        """``settings`` (overrides on the user's config) built as a training run."""
        return RunArm(self, self.cfg(settings))

    def planned_steps(self) -> Optional[int]:
        return self.base.train.max_steps

    def planned_samples(self) -> Optional[int]:
        """The training samples of the run the config plans: ``train.max_steps`` × its samples per optimizer step
        (:class:`~train.data.layout_cost.LayoutCost`), or ``train.epochs`` × the training split; None when neither
        says."""
        t = self.base.train
        if t.max_steps:
            return int(t.max_steps * self._cost(self.base).samples_per_step)
        if t.epochs:
            return int(t.epochs * len(self.bundle.splits["train"]))
        return None

    def samples_per_step(self, settings: dict[str, Any]) -> Optional[float]:
        """The mean samples per optimizer step of ``settings`` on the training lengths
        (:class:`~train.data.layout_cost.LayoutCost`)."""
        return self._cost(self.cfg(settings)).samples_per_step

    def context(self, settings: dict[str, Any]) -> LeverContext:
        cfg = self.cfg(settings)
        caps = self._capabilities()
        packing, cuda = caps.supports_packing, self.device.type == "cuda"
        return LeverContext(cfg=cfg, device_type=self.device.type, supports_packing=packing,
                            dropout_modules=caps.dropout_modules, attention_paths=caps.attention_paths,
                            native_bf16=cpu_native_bf16(), cuda_bf16=cuda and torch.cuda.is_bf16_supported(),
                            fused_adamw=fused_adamw_supported(self.device), torch_threads=self.default_threads,
                            planned_steps=self.planned_steps(), batch_shapes=len(replan(cfg, self.bundle).bounds),
                            base_budget=self.base_budget, batching_costs=self.batching_costs(cfg, packing))

    def batching_costs(self, cfg: RunConfig, packing: bool) -> dict[str, Any]:
        """The :class:`~train.data.layout_cost.LayoutCost` on the training lengths of ``cfg`` (``"current"``) and of
        each batching value the lever may propose (cached per setting)."""
        configs = {"current": cfg} | {v: cfg.with_values(batching_settings(cfg, v)) for v in BATCHING
                                      if v != "packed" or packing}
        return {name: self._cost(c) for name, c in configs.items()}

    def _cost(self, cfg: RunConfig) -> Any:
        key = repr(cfg.batching) + repr(cfg.data) + repr(cfg.train.seed)
        if key not in self._costs:
            self._costs[key] = layout_cost(cfg, self.bundle.splits["train"].lengths, replan(cfg, self.bundle).bounds)
        return self._costs[key]

    def real_tokens_per_sample(self) -> float:
        """The training split's mean tokens per sample after truncation to ``data.max_len`` (converts real tokens per
        second into samples per second: every configuration trains the same samples)."""
        return self._cost(self.base).real_tokens

    def schedule(self, settings: dict[str, Any]) -> dict[str, Any]:
        """The overrides that keep ``settings``' run on the schedule of the config as given, in samples
        (:func:`~train.optimize.schedule.schedule_in_samples`, ``optimize.lr_scaling``): only those that differ
        from what ``settings`` already say. ``k`` is the ratio of the two plans' samples per optimizer step."""
        cfg = self.cfg(settings)
        base_sps, sps = self._cost(self.base).samples_per_step, self._cost(cfg).samples_per_step
        want = schedule_in_samples(self.base, sps / base_sps if base_sps and sps else 1.0,
                                   self.base.optimize.lr_scaling)
        return {k: v for k, v in want.items()
                if k in SCHEDULE_KEYS and cfg.value(k) != v}

    def profile(self, settings: dict[str, Any], index: int) -> Evidence:
        """A short torch.profiler window on ``settings`` (3 untimed steps — the second, before the profiler starts
        recording, times the step for the search's first estimates —, then ``optimize.profile_steps`` captured) and
        the attribution of ``make profile``, reduced to the shares the levers read.

        Raises:
            OutOfTime: the next step (as long as the last) would end past the command's deadline.
        """
        cfg = self.cfg(settings)
        steps = cfg.optimize.profile_steps
        pcfg = cfg.with_values({"profile.wait": 2, "profile.warmup": 1, "profile.active": steps}).profile
        out = self.out_dir / "profiles" / str(index)
        arm = RunArm(self, cfg)
        try:
            trainer = arm.run.trainer
            window = TorchProfileWindow(pcfg, out, self.device)
            window.attach(trainer)
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
            samples, ms = [], []
            for step in range(1, steps + 4):
                why = None if self.deadline is None else budget_reason(
                    self.deadline, f"the profile's step {step} of {steps + 3}", ms[-1] / 1e3 if ms else 1e-9)
                if why is not None:
                    window.close()
                    raise OutOfTime(why)
                rec = trainer.step(resolve=True)
                samples.append(rec.samples)
                ms.append(rec.ms or 0.0)
                for cb in tuple(trainer.callbacks):
                    cb.on_step_end(step, rec.ms)
            if not window.done:
                window.close()
            ev = self._evidence(cfg, window, samples[3:], out)
            ev.steps_s = sum(ms) / 1e3
            # step 2: the profiler still waits, and the first step's one-off work (allocation, the loader) is done
            ev.unprofiled_samples_per_s = samples[1] / (ms[1] / 1e3) if ms[1] else None
            return ev
        finally:
            arm.close()

    def _evidence(self, cfg: RunConfig, w: TorchProfileWindow, samples: list[int], out: Path) -> Evidence:
        dev = self.device
        mode = self.policy(cfg).mode
        if mode not in self._roofline:
            name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else device_name(dev)
            self._roofline[mode] = ridge_point(dev, name, mode)
        real, padded = w.tokens.get("real_tokens", 0), w.tokens.get("padded_tokens", 0)
        total_us = sum(w.step_us)
        summary = build_summary(w.ops, device_type=dev.type, step_total_us=total_us, active_steps=len(w.step_us),
                                stage_us=w.stage_us, roofline=self._roofline[mode], th=cfg.profile,
                                default_bytes=2 if mode in ("bf16", "fp16") else 4,
                                ctx={"padding_share": 1 - real / padded if padded else None,
                                     "batching_method": cfg.batching.method, "num_workers": cfg.data.num_workers,
                                     "precision": mode})
        write_summary(out, summary)
        by, shares = summary["share_by_verdict"], summary["breakdown_share"]
        mask_us = sum(r.self_us(dev.type) for r in w.ops if r.name in DROPOUT_MASK_OPS)
        attention_us = sum(r.self_us(dev.type) for r in w.ops if is_attention_op(r.name, r.input_shapes or []))
        table = summary["table"]
        ev = Evidence(step_ms=summary["step_time_ms"], padding_share=summary["context"]["padding_share"],
                      compute_share=by.get(COMPUTE, 0.0), memory_share=by.get(MEMORY, 0.0),
                      launch_share=by.get(LAUNCH, 0.0), data_wait_share=shares.get("data_wait"),
                      optimizer_share=shares.get("optimizer"), other_share=shares.get("other"),
                      loss_share=shares.get("loss"),
                      dropout_mask_share=mask_us / total_us if total_us else None,
                      attention_share=attention_us / total_us if total_us else None,
                      top_op=table[0]["op"] if table else None,
                      top_memory_op=next((r["op"] for r in table if r["verdict"] == MEMORY), None))
        if w.timer_ms and samples:
            ev.samples_per_s = sum(samples[:len(w.timer_ms)]) / (sum(w.timer_ms) / 1e3)
        if dev.type == "cuda":
            ev.peak_memory_bytes = int(torch.cuda.max_memory_allocated(dev))
            ev.memory_total_bytes = int(torch.cuda.get_device_properties(dev).total_memory)
        else:
            ev.notes["memory"] = "CPU: host memory is not the limit here; the token-budget lever is bounded by " \
                                 "optimize.max_budget_factor"
        ev.notes["summary"] = str(out / "summary.md")
        return ev
