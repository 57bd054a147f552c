"""Run configuration: nested dataclasses composed into one :class:`RunConfig`.

A run's config comes from (lowest to highest priority) the dataclass defaults, a YAML file
(``--config configs/cpu-tiny.yaml``) and ``section.key=value`` overrides on the command line
(values parsed as YAML, so ``train.max_steps=200`` is an int and ``data.max_samples=null`` is None).
Unknown keys and wrongly typed values raise :class:`~train.errors.UserError` naming the key and,
for typos, the nearest valid key.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import yaml

from train.errors import UserError


@dataclass
class DataConfig:
    """Where the examples come from and how they are tokenized."""

    source: str = "wordnet"
    """``wordnet`` (built-in), a path to a ``.jsonl``/``.csv``/``.parquet`` file, or ``hf:NAME[:CONFIG]``."""
    wordnet_dir: Optional[str] = None
    """WNDB directory; default: search ``$WNHOME``, ``$WNHOME/dict``, /usr/share/wordnet, nltk_data."""
    text_field: str = "text"
    """Column/key holding the input text (file and HF sources)."""
    label_field: str = "label"
    """Column/key holding the label: a string, or an int in ``[0, num_classes)``."""
    num_classes: Optional[int] = None
    """For int labels: the number of classes (labels outside ``[0, num_classes)`` are an error). Default: max label + 1."""
    val_fraction: float = 0.05
    """Fraction of examples in the validation split (by stable hash)."""
    test_fraction: float = 0.05
    """Fraction of examples in the test split (by stable hash)."""
    max_samples: Optional[int] = None
    """Cap the training split at this many examples (validation/test at a tenth each); None = all."""
    max_len: int = 128
    """Maximum sequence length in tokens, ``[CLS]`` and ``[SEP]`` included; longer inputs are truncated and counted."""
    vocab_size: int = 8192
    """WordPiece vocabulary size when the tokenizer is trained on the training split."""
    tokenizer_path: Optional[str] = None
    """A user-supplied ``tokenizer.json`` (Hugging Face tokenizers format); None = train WordPiece and cache it."""
    cache_dir: str = ".cache/deep-model-perf"
    """Where trained tokenizers, prepared (tokenized) data and per-machine decisions are cached, keyed by fingerprint."""
    cache_prepared: bool = True
    """Reuse the split, tokenized data from ``<cache_dir>/data/`` when the source's content and the settings match
    (train/data/cache.py); false = read and tokenize the source on every run."""
    num_workers: int = 0
    """DataLoader worker processes (0 = load in the training process)."""

    def __post_init__(self) -> None:
        if not 0 <= self.val_fraction < 1 or not 0 <= self.test_fraction < 1:
            raise UserError("data.val_fraction and data.test_fraction must be in [0, 1)")
        if self.val_fraction + self.test_fraction >= 1:
            raise UserError("data.val_fraction + data.test_fraction must be < 1 so the training split is not empty")
        if self.max_len < 3:
            raise UserError(f"data.max_len={self.max_len} is too small: it must hold [CLS], one token and [SEP] (≥ 3)")
        if self.vocab_size < 10:
            raise UserError(f"data.vocab_size={self.vocab_size} is too small (≥ 10)")
        if self.max_samples is not None and self.max_samples < 1:
            raise UserError("data.max_samples must be ≥ 1 or null")
        if self.num_classes is not None and self.num_classes < 2:
            raise UserError("data.num_classes must be ≥ 2 or null")
        if self.num_workers < 0:
            raise UserError("data.num_workers must be ≥ 0")


@dataclass
class BatchingConfig:
    """How examples are grouped into batches and padded."""

    method: str = "optimal"
    """Bucket boundaries: ``optimal`` (minimum-padding DP), ``quantile``, ``kmeans``; or no buckets:
    ``pad-to-max`` (every batch padded to ``data.max_len``), ``random`` (random batches padded to the batch max),
    ``hf-group-by-length`` (Hugging Face's megabatch length grouping, padded to the batch max; a baseline)."""
    num_buckets: int = 8
    """K, the number of buckets (= distinct sequence lengths) for the bucketed methods."""
    batch_size: int = 64
    """Samples per batch when ``max_tokens`` is not set."""
    max_tokens: Optional[int] = None
    """Token budget per batch (fairseq-style): a bucket of bound L gets ⌊max_tokens / L⌋ samples."""
    round_to: int = 1
    """Round bucket bounds up to a multiple of this (8 suits tensor cores); 1 = exact."""
    drop_last: bool = False
    """Drop each bucket's last incomplete batch (counted in the report) instead of keeping it."""
    boundaries_file: Optional[str] = None
    """A bucket-boundaries JSON from ``python -m train buckets``; None = fit on the fly and save into the run."""
    pad_to: str = "bound"
    """Bucketed methods: ``bound`` pads every batch to its bucket bound (static shapes, at most K lengths);
    ``batch-max`` pads to the longest sample in the batch (less padding, more distinct shapes: see
    ``batching.distinct_shapes`` in report.json)."""

    def __post_init__(self) -> None:
        allowed = ("optimal", "quantile", "kmeans", "pad-to-max", "random", "hf-group-by-length")
        if self.method not in allowed:
            raise UserError(f"batching.method={self.method!r} is not one of {', '.join(allowed)}")
        if self.num_buckets < 1:
            raise UserError("batching.num_buckets must be ≥ 1")
        if self.batch_size < 1:
            raise UserError("batching.batch_size must be ≥ 1")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise UserError("batching.max_tokens must be ≥ 1 or null")
        if self.round_to < 1:
            raise UserError("batching.round_to must be ≥ 1")
        if self.pad_to not in ("bound", "batch-max"):
            raise UserError(f"batching.pad_to={self.pad_to!r} must be 'bound' or 'batch-max'")


@dataclass
class ModelConfig:
    """The encoder classifier. ``preset`` fills the sizes; explicit sizes override the preset."""

    preset: str = "tiny"
    """``tiny`` (4 layers, 256 hidden, 4 heads, FFN 1024), ``small`` (6/512/8/2048), ``bert-base`` (12/768/12/3072)."""
    num_layers: Optional[int] = None
    hidden_size: Optional[int] = None
    num_heads: Optional[int] = None
    ffn_size: Optional[int] = None
    dropout: float = 0.1
    """Dropout probability on embeddings, attention output and FFN output."""
    pooling: str = "mean"
    """``mean`` (average of real tokens) or ``cls`` (the first token)."""

    def __post_init__(self) -> None:
        from train.model import PRESETS  # local import: model imports nothing from config

        if self.preset not in PRESETS:
            raise UserError(f"model.preset={self.preset!r} is not one of {', '.join(PRESETS)}")
        if self.pooling not in ("mean", "cls"):
            raise UserError(f"model.pooling={self.pooling!r} must be 'mean' or 'cls'")
        if not 0 <= self.dropout < 1:
            raise UserError("model.dropout must be in [0, 1)")


@dataclass
class OptimConfig:
    """AdamW with linear warm-up then linear decay to zero."""

    lr: float = 1e-3
    """Peak learning rate."""
    weight_decay: float = 0.01
    """Decoupled weight decay (not applied to biases, LayerNorm and embeddings)."""
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    warmup_fraction: float = 0.06
    """Fraction of the total steps spent warming the learning rate up linearly from 0."""
    clip_norm: Optional[float] = None
    """Deprecated alias of ``clip.max_norm``, kept so older configs work: a number sets ``clip.max_norm``.
    After loading it mirrors the effective global-norm threshold (null unless ``clip.method=global-norm``);
    disable clipping with ``clip.method=none``."""
    fused: Optional[bool] = None
    """AdamW's fused kernel; null = use it where torch supports it on the device (CUDA; CPU from torch 2.4),
    which also lets the numerics guard skip a bad step on the device without a host sync."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise UserError("optim.lr must be > 0")
        if not 0 <= self.warmup_fraction < 1:
            raise UserError("optim.warmup_fraction must be in [0, 1)")
        self.betas = tuple(self.betas)
        if len(self.betas) != 2:
            raise UserError("optim.betas must be two numbers, e.g. [0.9, 0.999]")


@dataclass
class ClipConfig:
    """Gradient clipping (train/clipping.py), on gradients in true units (after GradScaler.unscale_)."""

    method: str = "global-norm"
    """``global-norm`` (scale all gradients to L2 norm ≤ max_norm), ``per-layer-std`` (clamp each parameter's
    gradient to ±std_k·σ of that gradient), ``agc`` (adaptive gradient clipping, Brock et al. 2021), ``none``."""
    max_norm: float = 1.0
    """``global-norm`` threshold on the L2 norm of all gradients."""
    std_k: float = 2.5
    """``per-layer-std``: clamp at ±std_k standard deviations of each gradient."""
    agc_lambda: float = 0.01
    """``agc``: the clipping factor λ, the largest allowed ‖G_i‖ / max(‖W_i‖, agc_eps) per unit (row)."""
    agc_eps: float = 1e-3
    """``agc``: floor on the weight norm ε, so zero-initialised units can still move."""

    def __post_init__(self) -> None:
        from train.clipping import METHODS

        if self.method not in METHODS:
            raise UserError(f"clip.method={self.method!r} is not one of {', '.join(METHODS)}")
        if self.max_norm <= 0 or self.std_k <= 0 or self.agc_lambda <= 0 or self.agc_eps <= 0:
            raise UserError("clip.max_norm, clip.std_k, clip.agc_lambda and clip.agc_eps must be > 0")


@dataclass
class NumericsConfig:
    """The numerics guard (train/numerics.py): skip non-finite steps, name the culprit, abort."""

    max_bad_steps: int = 10
    """Stop the run (exit code 3) after this many consecutive steps with non-finite loss or gradients."""
    diagnose: bool = True
    """After a bad step, attach forward hooks for the next logging window to name the first module whose
    output is non-finite (hooks are never attached while the run is healthy)."""

    def __post_init__(self) -> None:
        if self.max_bad_steps < 1:
            raise UserError("numerics.max_bad_steps must be ≥ 1")


@dataclass
class TrainConfig:
    """The loop: how long, how often to evaluate/log, where to write."""

    max_steps: Optional[int] = None
    """Optimizer steps to run; None = ``epochs`` full passes over the training split."""
    epochs: float = 1.0
    """Passes over the training split when ``max_steps`` is null."""
    eval_every: int = 500
    """Evaluate on the validation split every N steps (and always at the end)."""
    log_every: int = 10
    """Write a metrics.jsonl record every N steps (values aggregated over those steps)."""
    seed: int = 0
    device: str = "auto"
    """``auto`` (CUDA when available, else CPU), ``cpu``, ``cuda``, ``cuda:N``."""
    precision: str = "auto"
    """``auto``, ``fp32``, ``bf16``, ``fp16`` (see train/precision.py for what ``auto`` picks and why)."""
    num_threads: Optional[int] = None
    """torch intra-op threads on CPU; None = torch's default."""
    output_dir: str = "runs"
    run_id: Optional[str] = None
    """Run directory name under ``output_dir``; None = a timestamp."""
    progress: bool = True
    """Show a tqdm progress bar (loss, samples/s, padding %)."""
    checkpoint_every: Optional[int] = 500
    """Write a resumable checkpoint to ``runs/<id>/checkpoints/`` every N steps; null = only the final ``checkpoint.pt``."""
    keep_checkpoints: int = 3
    """How many periodic checkpoints to keep (the newest; older ones are deleted after each write)."""
    shutdown_timeout_s: float = 60.0
    """After SIGTERM/SIGINT the run finishes its step, checkpoints and reports; it exits anyway after this many seconds."""

    def __post_init__(self) -> None:
        if self.max_steps is not None and self.max_steps < 1:
            raise UserError("train.max_steps must be ≥ 1 or null")
        if self.epochs <= 0:
            raise UserError("train.epochs must be > 0")
        if self.eval_every < 1 or self.log_every < 1:
            raise UserError("train.eval_every and train.log_every must be ≥ 1")
        if self.precision not in ("auto", "fp32", "bf16", "fp16"):
            raise UserError(f"train.precision={self.precision!r} is not one of auto, fp32, bf16, fp16")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise UserError("train.checkpoint_every must be ≥ 1 or null")
        if self.keep_checkpoints < 1:
            raise UserError("train.keep_checkpoints must be ≥ 1")
        if self.shutdown_timeout_s <= 0:
            raise UserError("train.shutdown_timeout_s must be > 0")


@dataclass
class ProfileConfig:
    """``python -m train profile``: which steps are captured and how the attribution is judged (train/profiling)."""

    wait: int = 2
    """torch.profiler schedule: steps skipped first (cold steps: allocator warm-up, lazy init)."""
    warmup: int = 2
    """torch.profiler schedule: steps traced but discarded (the profiler's own warm-up)."""
    active: int = 5
    """torch.profiler schedule: steps recorded. Bounded (≤ 20) because it sets the trace size."""
    top_k: int = 10
    """Rows in the attribution table (ops by self device time on CUDA, self CPU time on CPU)."""
    max_trace_mb: float = 50.0
    """Size cap for the gzipped Chrome/Perfetto trace; a larger trace is deleted and reported (lower ``active``)."""
    pyspy_steps: int = 12
    """py-spy: steps per window; windows run off/on/off/on/off, so overhead compares medians side by side."""
    pyspy_rate: int = 100
    """py-spy sampling rate (samples per second)."""
    pyspy_native: bool = True
    """py-spy ``--native``: include C/C++ frames (torch's kernels) in the stacks."""
    nsys_steps: int = 5
    """Nsight Systems: steps inside the capture range (cudaProfilerStart/Stop)."""
    gpu_sample_ms: int = 100
    """NVML sampling interval during CUDA profiles, milliseconds."""
    data_bound_share: float = 0.10
    """A step is data-bound when waiting on the DataLoader takes at least this share of it."""
    padding_share: float = 0.25
    """Recommend bucketing when at least this share of the processed tokens is padding."""
    launch_us: float = 10.0
    """An op whose mean time per call is below this many µs is launch/dispatch-bound."""

    def __post_init__(self) -> None:
        if self.wait < 0 or self.warmup < 0:
            raise UserError("profile.wait and profile.warmup must be ≥ 0")
        if not 1 <= self.active <= 20:
            raise UserError(f"profile.active={self.active} must be in [1, 20] (it bounds the trace size)")
        if self.top_k < 1:
            raise UserError("profile.top_k must be ≥ 1")
        if self.max_trace_mb <= 0:
            raise UserError("profile.max_trace_mb must be > 0")
        if self.pyspy_steps < 3 or self.pyspy_rate < 1 or self.nsys_steps < 1 or self.gpu_sample_ms < 10:
            raise UserError("profile: pyspy_steps ≥ 3, pyspy_rate ≥ 1, nsys_steps ≥ 1 and gpu_sample_ms ≥ 10 are required")
        for name in ("data_bound_share", "padding_share"):
            if not 0 < getattr(self, name) < 1:
                raise UserError(f"profile.{name} must be in (0, 1)")
        if self.launch_us <= 0:
            raise UserError("profile.launch_us must be > 0")


@dataclass
class TrackingConfig:
    """Experiment tracking beside metrics.jsonl (always written): W&B, system metrics, gradient statistics.

    The scalar cadence is ``train.log_every``. See train/tracking_wandb.py and README "Experiment tracking".
    """

    wandb: Union[str, bool] = "auto"
    """``auto`` (W&B when the package imports, else JSONL only, silently), ``on`` (W&B; a warning if it fails), ``off``.
    (YAML reads on/off as booleans; true/false are accepted as on/off.)"""
    mode: str = "auto"
    """W&B mode: ``auto`` ($WANDB_MODE if set, else ``offline``), ``offline``, or ``online`` (needs an API key:
    $WANDB_API_KEY or ``wandb login``; without one the run logs offline). ``WANDB_MODE=disabled`` turns W&B off."""
    project: str = "deep-model-perf"
    """W&B project name."""
    init_timeout_s: float = 60.0
    """Longest the run waits for ``wandb.init`` (which starts while the data is prepared); then JSONL only."""
    finish_timeout_s: float = 30.0
    """Longest the run waits at the end for queued W&B records and ``wandb.finish``."""
    queue_size: int = 10000
    """Records waiting for the W&B thread; when full, new records are dropped and counted (never blocks)."""
    watch: Union[str, bool] = "off"
    """``wandb.watch(model, log=…)``: ``off``, ``gradients``, ``parameters`` or ``all`` (histograms; the hooks run
    in the training thread)."""
    watch_log_freq: int = 100
    """``wandb.watch`` log_freq: histograms every N backward passes."""
    system_interval_s: float = 5.0
    """Seconds between system-metric samples (CPU %, RSS; NVML GPU utilisation/memory/power); 0 = off."""
    grad_stats_every: int = 10
    """Per-layer gradient norm/std record (``"event": "grad_stats"``) every N logged records; 0 = off."""

    def __post_init__(self) -> None:
        if isinstance(self.wandb, bool):
            self.wandb = "on" if self.wandb else "off"
        if isinstance(self.watch, bool):
            self.watch = "gradients" if self.watch else "off"
        if self.wandb not in ("auto", "on", "off"):
            raise UserError(f"tracking.wandb={self.wandb!r} is not one of auto, on, off")
        if self.mode not in ("auto", "offline", "online"):
            raise UserError(f"tracking.mode={self.mode!r} is not one of auto, offline, online")
        if self.watch not in ("off", "gradients", "parameters", "all"):
            raise UserError(f"tracking.watch={self.watch!r} is not one of off, gradients, parameters, all")
        if self.init_timeout_s <= 0 or self.finish_timeout_s <= 0:
            raise UserError("tracking.init_timeout_s and tracking.finish_timeout_s must be > 0")
        if self.queue_size < 1 or self.watch_log_freq < 1:
            raise UserError("tracking.queue_size and tracking.watch_log_freq must be ≥ 1")
        if self.system_interval_s < 0 or self.grad_stats_every < 0:
            raise UserError("tracking.system_interval_s and tracking.grad_stats_every must be ≥ 0 (0 = off)")


@dataclass
class CompileConfig:
    """``torch.compile`` of the model, warm-up per batch shape, the persistent cache (train/compilation.py)."""

    enabled: Union[bool, str] = "auto"
    """``true``, ``false`` or ``auto``: on for CUDA; off on CPU, where it was measured to give no steady-state
    speedup for the tiny model and a cold compile of tens of seconds (README "torch.compile"; re-measure with
    ``python -m train bench-compile``)."""
    mode: str = "default"
    """``default``, ``reduce-overhead`` (CUDA graphs; needs the static bucket shapes) or ``max-autotune``."""
    dynamic: bool = False
    """False: one static graph per (batch, length) shape, which bucketing keeps few; True: symbolic shapes."""
    backend: str = "inductor"
    """The torch.compile backend. ``aot_eager`` traces the same graphs with the same guards (so the same recompiles)
    without inductor's code generation: a quick way to check recompile behaviour on a slow machine."""
    fullgraph: bool = False
    """Fail instead of splitting the model into several graphs at a graph break."""
    warmup: bool = True
    """Before training, compile and run every planned batch shape (train and eval) until its step time is stable;
    weights, optimizer state and RNG are restored afterwards."""
    warmup_eval: bool = True
    """Warm the evaluation shapes too (their graphs are separate: no autograd, dropout off)."""
    warmup_cv: float = 0.05
    """A shape is stable when the coefficient of variation (std/mean) of its last ``warmup_window`` step times is ≤ this."""
    warmup_window: int = 5
    """n, the number of most recent steps whose CV decides stability."""
    warmup_max_steps: int = 30
    """Cap on timed steps per shape after the compiling one; a shape that reaches it is reported as not stable."""
    cache_dir: Optional[str] = None
    """Persistent compile cache (``TORCHINDUCTOR_CACHE_DIR``; ``TRITON_CACHE_DIR`` = its ``triton/``). None:
    ``$TORCHINDUCTOR_CACHE_DIR`` if set, else ``.cache/inductor``. Unwritable → a per-user temp dir, with a warning."""
    recompile_limit: Optional[int] = None
    """dynamo's limit on compiled variants of the forward; None = max(torch's default, planned graphs + 8)."""

    def __post_init__(self) -> None:
        if isinstance(self.enabled, bool):
            self.enabled = "true" if self.enabled else "false"
        if self.enabled not in ("auto", "true", "false"):
            raise UserError(f"compile.enabled={self.enabled!r} is not one of true, false, auto")
        if self.mode not in ("default", "reduce-overhead", "max-autotune"):
            raise UserError(f"compile.mode={self.mode!r} is not one of default, reduce-overhead, max-autotune")
        if self.backend != "inductor" and self.mode != "default":
            raise UserError(f"compile.mode={self.mode!r} needs compile.backend=inductor (got {self.backend!r})")
        if not 0 < self.warmup_cv < 1:
            raise UserError("compile.warmup_cv must be in (0, 1), e.g. 0.05 for 5%")
        if self.warmup_window < 2:
            raise UserError("compile.warmup_window must be ≥ 2 (a CV needs two step times)")
        if self.warmup_max_steps < self.warmup_window:
            raise UserError(f"compile.warmup_max_steps={self.warmup_max_steps} must be ≥ compile.warmup_window={self.warmup_window}")
        if self.recompile_limit is not None and self.recompile_limit < 1:
            raise UserError("compile.recompile_limit must be ≥ 1 or null")


@dataclass
class RunConfig:
    """Everything a run needs; saved fully resolved as ``runs/<id>/config.yaml``."""

    data: DataConfig = field(default_factory=DataConfig)
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    clip: ClipConfig = field(default_factory=ClipConfig)
    numerics: NumericsConfig = field(default_factory=NumericsConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)

    def __post_init__(self) -> None:
        # optim.clip_norm is the old name of clip.max_norm: accept it, and keep it mirroring clip.max_norm.
        legacy, default = self.optim.clip_norm, ClipConfig.max_norm
        if legacy is not None and legacy != self.clip.max_norm:
            if self.clip.max_norm != default:
                raise UserError(f"optim.clip_norm={legacy} and clip.max_norm={self.clip.max_norm} disagree; "
                                "set only clip.max_norm (optim.clip_norm is its old name)")
            if legacy <= 0:
                raise UserError("optim.clip_norm must be > 0 (disable clipping with clip.method=none)")
            self.clip.max_norm = float(legacy)
        self.optim.clip_norm = self.clip.max_norm if self.clip.method == "global-norm" else None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["optim"]["betas"] = list(self.optim.betas)
        return d


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _check_type(value: Any, hint: Any, key: str) -> Any:
    """Return ``value`` converted to ``hint`` where lossless (int → float), else raise UserError."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check_type(value, arg, key)
            except UserError:
                pass
        raise UserError(f"config key {key!r}: {value!r} is not a valid {_hint_name(hint)}")
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):
        try:  # YAML 1.1 reads "5e-3" (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if hint is tuple and isinstance(value, (list, tuple)):
        return tuple(value)
    if hint in (int, float, str, bool) and (type(value) is hint):
        return value
    if hint is Any:
        return value
    raise UserError(f"config key {key!r}: {value!r} is not a valid {_hint_name(hint)}")


def _hint_name(hint: Any) -> str:
    args = typing.get_args(hint)
    if args:
        return " or ".join("null" if a is type(None) else a.__name__ for a in args)
    return getattr(hint, "__name__", str(hint))


def _suggest(key: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.5)
    return f" Did you mean {close[0]!r}?" if close else f" Valid keys: {', '.join(candidates)}."


def build_config(raw: dict[str, Any], where: str = "config") -> RunConfig:
    """Build a :class:`RunConfig` from a nested dict, validating every key and value type.

    Raises:
        UserError: unknown section or key (with the nearest valid name), wrong type, or a value
            a section's ``__post_init__`` rejects.
    """
    if not isinstance(raw, dict):
        raise UserError(f"{where}: expected a mapping of sections (data, batching, model, optim, train)")
    sections: dict[str, Any] = {}
    hints = typing.get_type_hints(RunConfig)
    for name, values in raw.items():
        if name not in hints:
            raise UserError(f"{where}: unknown section {name!r}.{_suggest(name, list(hints))}")
        cls = hints[name]
        if values is None:
            values = {}
        if not isinstance(values, dict):
            raise UserError(f"{where}: section {name!r} must be a mapping of keys")
        field_hints = typing.get_type_hints(cls)
        kwargs = {}
        for key, value in values.items():
            if key not in field_hints:
                full = [f"{name}.{k}" for k in _field_names(cls)]
                raise UserError(f"{where}: unknown key '{name}.{key}'.{_suggest(f'{name}.{key}', full)}")
            kwargs[key] = _check_type(value, field_hints[key], f"{name}.{key}")
        sections[name] = cls(**kwargs)
    return RunConfig(**sections)


def parse_override(text: str) -> tuple[list[str], Any]:
    """Parse ``section.key=value`` (value as YAML). Raises UserError for a malformed override."""
    if "=" not in text:
        raise UserError(f"override {text!r} must look like section.key=value, e.g. train.max_steps=200")
    key, value = text.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise UserError(f"override {text!r}: the key must be section.key, e.g. train.max_steps")
    try:
        parsed = yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError as exc:
        raise UserError(f"override {text!r}: the value is not valid YAML ({exc.__class__.__name__})") from None
    return parts, parsed


def load_config(path: Optional[str], overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Load ``path`` (YAML, may be None for defaults) and apply ``section.key=value`` overrides.

    Raises:
        UserError: missing/unparsable file, unknown key, wrong type, invalid value.
    """
    raw: dict[str, Any] = {}
    where = "config"
    if path is not None:
        p = Path(path)
        where = str(p)
        if not p.is_file():
            raise UserError(f"config file {p} does not exist (configs/ holds cpu-tiny.yaml, smoke.yaml, gpu-bert-base.yaml)")
        try:
            raw = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            line = f":{mark.line + 1}" if mark is not None else ""
            raise UserError(f"{p}{line}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
        if not isinstance(raw, dict):
            raise UserError(f"{p}: expected a mapping of sections (data, batching, model, optim, train)")
    for text in overrides:
        (section, key), value = parse_override(text)
        sec = raw.setdefault(section, {})
        if not isinstance(sec, dict):
            raise UserError(f"{where}: section {section!r} must be a mapping of keys")
        sec[key] = value
        where = f"{where} + overrides" if "overrides" not in where else where
    return build_config(raw, where)


def dump_config(cfg: RunConfig) -> str:
    """The fully resolved config as YAML text (what ``runs/<id>/config.yaml`` holds)."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
