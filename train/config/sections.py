"""The core ``RunConfig`` sections: ``data``, ``batching``, ``model``, ``optim``, ``clip``, ``numerics``, ``train``.
Each field has its docstring and is validated in ``__post_init__`` (bad values raise UserError naming the key)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

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
    """Show tqdm progress bars on a terminal (stderr): training (loss, samples/s, padding %), warm-up and the
    ``bench*`` commands (train/tools/progress.py). Never drawn when stderr is not a TTY."""
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
