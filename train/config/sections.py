"""The core ``RunConfig`` sections: ``data``, ``batching``, ``model``, ``optim``, ``clip``, ``numerics``, ``train``.
Each field has its docstring; its accepted values are declared on the field (``allowed(default, ge=…)`` /
``choices=…``) and checked in ``__post_init__`` (bad values raise UserError naming the key, the value and the range)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from train.errors import Frozen, UserError, allowed, check_fields

BATCHING_METHODS = ("optimal", "quantile", "kmeans", "pad-to-max", "random", "hf-group-by-length", "packed", "auto")


@dataclass
class DataConfig(Frozen):
    """Where the examples come from and how they are tokenized."""

    source: str = "wordnet"
    """``wordnet`` (built-in), a path to a ``.jsonl``/``.csv``/``.parquet`` file, or ``hf:NAME[:CONFIG]``."""
    wordnet_dir: Optional[str] = None
    """WNDB directory; default: search ``$WNHOME``, ``$WNHOME/dict``, /usr/share/wordnet, nltk_data."""
    text_field: str = "text"
    """Column/key holding the input text (file and HF sources)."""
    label_field: str = "label"
    """Column/key holding the label: a string, or an int in ``[0, num_classes)``."""
    prompt_field: str = "prompt"
    """``model.task=causal-lm``: column/key of a row's prompt (context only, never a target); a row has either a
    text (every token trained) or a prompt + completion."""
    completion_field: str = "completion"
    """``model.task=causal-lm``: column/key of a row's completion (its tokens and the EOS after it are the targets)."""
    messages_field: str = "messages"
    """``model.task=causal-lm``: key of a chat row's conversation (TRL's ``[{"role", "content"}, ...]``), rendered with
    the model's chat template, the final assistant turn the target (train/data/chat.py)."""
    wordnet_format: str = allowed("text", choices=("text", "chat"))
    """``data.source=wordnet`` with ``model.task=causal-lm``: ``text`` (each gloss a text row) or ``chat`` (each synset
    a conversation: the user's ``Define <word>.``, the gloss as the assistant's answer; needs a chat template)."""
    num_classes: Optional[int] = allowed(None, ge=2)
    """For int labels: the number of classes (labels outside ``[0, num_classes)`` are an error).
    Default: max label + 1."""
    val_fraction: float = allowed(0.05, ge=0, lt=1)
    """Fraction of examples in the validation split (by stable hash)."""
    test_fraction: float = allowed(0.05, ge=0, lt=1)
    """Fraction of examples in the test split (by stable hash)."""
    max_samples: Optional[int] = allowed(None, ge=1)
    """Cap the training split at this many examples (validation/test at a tenth each); None = all."""
    max_eval_samples: Optional[int] = allowed(None, ge=1)
    """Evaluate (validation, periodic and final, and test) on the first N examples of each split, in the split's
    fixed order: the same N every evaluation and run; None = all. report.json ``data.max_eval_samples`` and each
    evaluation's ``samples`` state it."""
    max_len: int = allowed(128, ge=3)
    """Maximum sequence length in tokens, ``[CLS]`` and ``[SEP]`` included; longer inputs are truncated and counted."""
    on_bad_row: str = allowed("drop", choices=("drop", "error"))
    """``model.task=causal-lm``: a row a model cannot learn from (an empty text or whitespace-only completion, a prompt
    longer than ``max_len``, a completion with no room after its prompt): ``drop`` leaves it out, counted by cause
    (one ``warning:`` line naming the first lines; report.json ``data.dropped_rows``), ``error`` refuses the data
    listing every such line at once (the first ten and the total; exit 2)."""
    long_text: str = allowed("truncate", choices=("truncate", "split"))
    """``model.task=causal-lm``: a sample longer than ``max_len``: ``truncate`` cuts it to ``max_len`` tokens (EOS
    kept; the tokens dropped counted), ``split`` cuts a text row into ``max_len`` chunks, each a sample, every token
    a target once (a prompt + completion row is still truncated). Classifiers truncate."""
    vocab_size: int = allowed(8192, ge=10)
    """Vocabulary size when the tokenizer is trained on the training split: WordPiece, or for ``model.task=causal-lm``
    a byte-level BPE (it has at least its 257 base tokens: the 256 bytes and ``<|endoftext|>``)."""
    tokenizer_path: Optional[str] = None
    """A user-supplied ``tokenizer.json`` (Hugging Face tokenizers format); None = train WordPiece and cache it."""
    cache_dir: str = ".cache/deep-model-perf"
    """Where trained tokenizers, prepared (tokenized) data and per-machine decisions are cached, keyed by
    fingerprint."""
    cache_prepared: bool = True
    """Reuse the split, tokenized data from ``<cache_dir>/data/`` when the source's content and the settings match
    (train/data/cache.py); false = read and tokenize the source on every run."""
    num_workers: int = allowed(0, ge=0)
    """DataLoader worker processes (0 = load in the training process)."""

    def __post_init__(self) -> None:
        check_fields(self, "data")
        if self.val_fraction + self.test_fraction >= 1:
            raise UserError("data.val_fraction + data.test_fraction must be < 1 so the training split is not empty")


@dataclass
class BatchingConfig(Frozen):
    """How examples are grouped into batches and padded."""

    method: str = allowed("optimal", choices=BATCHING_METHODS)
    """Bucket boundaries: ``optimal`` (minimum-padding DP), ``quantile``, ``kmeans``; or no buckets:
    ``pad-to-max`` (every batch padded to ``data.max_len``), ``random`` (random batches padded to the batch max),
    ``hf-group-by-length`` (Hugging Face's megabatch length grouping, padded to the batch max; a baseline);
    ``packed``: whole samples back to back in rows of ``pack_len`` tokens (least-slack rows; per-sample positions,
    block-diagonal attention: every sample's logits are its unpacked logits), one shape for the whole run;
    ``auto``: ``packed`` or ``optimal``, whichever trains more samples/s on this device, model and data (measured
    once, cached; train/data/batching_auto.py), ``optimal`` for a model that cannot pack."""
    num_buckets: int = allowed(8, ge=1)
    """K, the number of buckets (= distinct sequence lengths) for the bucketed methods."""
    batch_size: int = allowed(64, ge=1)
    """Samples per batch when ``max_tokens`` is not set."""
    max_tokens: Optional[int] = allowed(None, ge=1)
    """Token budget per batch (fairseq-style): a bucket of bound L gets ⌊max_tokens / L⌋ samples."""
    round_to: int = allowed(1, ge=1)
    """Round bucket bounds up to a multiple of this (8 suits tensor cores); 1 = exact."""
    drop_last: bool = False
    """Drop each bucket's last incomplete batch (counted in the report) instead of keeping it."""
    boundaries_file: Optional[str] = None
    """A bucket-boundaries JSON from ``python -m train buckets``; None = fit on the fly and save into the run."""
    pack_len: Optional[int] = allowed(None, ge=3)
    """``packed``: tokens per row; null = ``data.max_len`` (it may not exceed it: the position table)."""
    pack_window: int = allowed(4096, ge=1)
    """``packed``: samples packed together at a time (a shuffled window: bounded memory and packing time)."""
    pack_rows: Optional[int] = allowed(None, ge=1)
    """``packed``: rows per step; null = ``max_tokens // pack_len`` with a token budget, else about ``batch_size``
    samples' worth of rows (``ceil(batch_size × mean training length / pack_len)``)."""
    pad_to: str = allowed("bound", choices=("bound", "batch-max"))
    """Bucketed methods: ``bound`` pads every batch to its bucket bound (static shapes, at most K lengths);
    ``batch-max`` pads to the longest sample in the batch (less padding, more distinct shapes: see
    ``batching.distinct_shapes`` in report.json)."""

    def __post_init__(self) -> None:
        check_fields(self, "batching")


@dataclass
class ModelConfig(Frozen):
    """The encoder classifier. ``preset`` fills the sizes; explicit sizes override the preset."""

    preset: str = allowed("tiny", choices=("tiny", "small", "bert-base"))
    """``tiny`` (4 layers, 256 hidden, 4 heads, FFN 1024), ``small`` (6/512/8/2048), ``bert-base`` (12/768/12/3072)."""
    num_layers: Optional[int] = allowed(None, ge=1)
    hidden_size: Optional[int] = allowed(None, ge=1)
    num_heads: Optional[int] = allowed(None, ge=1)
    ffn_size: Optional[int] = allowed(None, ge=1)
    dropout: float = allowed(0.1, ge=0, lt=1)
    """Dropout probability on embeddings, attention output and FFN output."""
    pooling: str = allowed("mean", choices=("mean", "cls"))
    """``mean`` (average of real tokens) or ``cls`` (the first token)."""
    packed_attention: str = allowed("auto", choices=("auto", "sdpa-mask", "flex", "varlen", "eager-mask"))
    """Attention of packed rows (``batching.method=packed``): ``sdpa-mask`` (``scaled_dot_product_attention`` with a
    block-diagonal bool mask, every torch), ``flex`` (the built-in encoder: FlexAttention with a document block mask,
    torch ≥ 2.5 with a backward on the device, i.e. not CPU in torch 2.13; no attention-probability dropout),
    ``varlen`` (causal LMs: each sample's causal attention over itself, samples of similar length batched into SDPA
    calls; eager runs, no sliding window), ``eager-mask`` (causal LMs: the same mask added to the scores in
    transformers' eager attention, no fused kernel), or ``auto``: the fastest of the model's other paths that run
    (``flex``: with ``model.dropout`` 0) where it measures ≥ 1.0× as fast on the run's packed shape (measured once,
    cached; train/data/attention.py), else ``sdpa-mask`` with the reason."""
    fast_dropout: Union[bool, str] = allowed("auto", choices=("auto", "true", "false"))
    """Swap the model's ``nn.Dropout`` modules for :class:`train.models.dropout.FastDropout` (the same keep probability
    and scaling — p rounded to a multiple of 2^-16 —, the mask drawn as 16-bit uniform integers, four per 64-bit
    generator draw, compared with a threshold — a quarter of the draws of ``bernoulli_`` and no float conversion —,
    so a different random stream): ``true``, ``false``, or ``auto``: swapped only where one training
    step measures faster with it (interval above 1.0; measured once, cached; train/models/dropout.py)."""
    chunked_loss: Union[bool, str] = allowed("auto", choices=("auto", "true", "false"))
    """Causal LMs: the LM head and cross-entropy computed over chunks of tokens, each chunk's gradient taken in the
    forward pass, so the fp32 ``[tokens, vocab]`` logits never exist whole (train/tasks/chunked_loss.py): ``true``,
    ``false``, or ``auto``: on unless the head + loss measures > 1.05× slower chunked on the run's token budget
    (measured once per run). Classifiers: nothing to chunk."""
    task: str = allowed("classification", choices=("classification", "causal-lm"))
    """What the model learns (train/tasks/): ``classification`` (one label per text: cross-entropy over ``[N, C]``
    logits) or ``causal-lm`` (next-token prediction over ``text`` or ``prompt`` + ``completion`` rows, the loss on
    the trained tokens only; ``hf:`` decoders such as ``hf:llama``; docs/models.md)."""
    source: str = "builtin"
    """``builtin`` (the encoder above), ``hf:<dir>`` (a local Hugging Face model directory, never downloaded),
    ``hf:<model_type>`` (e.g. ``hf:bert``: random init sized by ``preset``) or ``python:package.module:function``
    (any nn.Module factory); see docs/models.md."""
    hf_overrides: Optional[dict] = None
    """``hf:`` sources: config keys set on the transformers config (e.g. ``{num_hidden_layers: 2}``), over the
    preset."""
    num_labels_mismatch: str = allowed("refuse", choices=("refuse", "resize"))
    """An ``hf:`` model whose ``num_labels`` differs from the data's classes: ``refuse`` (exit 2) or ``resize``
    (re-initialise the classification head, with a notice)."""
    adapter: Optional[dict] = None
    """Train a low-rank adapter instead of the whole model (``hf:`` sources; peft's LoRA): ``{type: lora, r: 16,
    alpha: 32, dropout: 0.0, targets: auto}`` (``auto``: the family's attention and MLP projections; or a list of
    module names). Only the adapter (and a classifier's head) trains; null = full fine-tuning (docs/models.md)."""

    def __post_init__(self) -> None:
        if isinstance(self.fast_dropout, bool):  # YAML true/false
            self.fast_dropout = "true" if self.fast_dropout else "false"
        if isinstance(self.chunked_loss, bool):
            self.chunked_loss = "true" if self.chunked_loss else "false"
        check_fields(self, "model")
        # a lever of the other task: refused before anything is prepared or written
        if self.chunked_loss == "true" and self.task != "causal-lm":
            raise UserError(f"model.chunked_loss=true: model.task={self.task} has logits [N, classes], nothing to "
                            "chunk; set model.chunked_loss=auto or false")
        theirs = {"varlen": "causal-lm", "eager-mask": "causal-lm", "flex": "classification"}.get(self.packed_attention)
        if theirs is not None and self.task != theirs:
            raise UserError(f"model.packed_attention={self.packed_attention} is for model.task={theirs} models; "
                            "set model.packed_attention=auto or sdpa-mask")
        from train.config.source import check_model_dir, source_kind

        # preset's choices are train.models.encoder.PRESETS' keys (a test keeps them equal)
        kind = source_kind(self.source)  # UserError for a malformed source
        check_model_dir(self.source)  # a missing hf:<dir> refused while the config is read, before a run directory
        from train.config.adapter import parse_adapter

        adapter = parse_adapter(self.adapter)
        self.adapter = None if adapter is None else adapter.as_dict()  # every key, so equal settings compare equal
        if adapter is not None and kind not in ("hf-dir", "hf-type"):
            what = "the built-in encoder" if kind == "builtin" else "a python: model"
            raise UserError(f"model.adapter: {what} cannot take a peft adapter (model.source={self.source}); adapters "
                            "wrap Hugging Face models: use model.source=hf:<dir> or hf:llama / hf:qwen2 / hf:gpt2 / "
                            "hf:bert, or remove model.adapter for full fine-tuning")


@dataclass
class OptimConfig(Frozen):
    """AdamW with linear warm-up then linear decay to zero."""

    lr: float = allowed(1e-3, gt=0)
    """Peak learning rate."""
    weight_decay: float = allowed(0.01, ge=0)
    """Decoupled weight decay (not applied to biases, LayerNorm and embeddings)."""
    betas: tuple = (0.9, 0.999)
    eps: float = allowed(1e-8, gt=0)
    warmup_fraction: float = allowed(0.06, ge=0, lt=1)
    """Fraction of the total steps spent warming the learning rate up linearly from 0."""
    clip_norm: Optional[float] = allowed(None, gt=0)
    """Deprecated alias of ``clip.max_norm``, kept so older configs work: a number sets ``clip.max_norm``.
    After loading it mirrors the effective global-norm threshold (null unless ``clip.method=global-norm``);
    disable clipping with ``clip.method=none``."""
    fused: Optional[bool] = None
    """AdamW's fused kernel; null = use it where torch supports it on the device (CUDA; CPU from torch 2.4),
    which also lets the numerics guard skip a bad step on the device without a host sync."""

    def __post_init__(self) -> None:
        check_fields(self, "optim")
        self.betas = tuple(self.betas)
        if len(self.betas) != 2 or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1
                                           for b in self.betas):
            raise UserError(f"optim.betas={list(self.betas)!r} must be two numbers in [0, 1), e.g. [0.9, 0.999]")


@dataclass
class ClipConfig(Frozen):
    """Gradient clipping (train/clipping.py), on gradients in true units (after GradScaler.unscale_)."""

    method: str = allowed("global-norm", choices=("global-norm", "per-layer-std", "agc", "none"))
    """``global-norm`` (scale all gradients to L2 norm ≤ max_norm), ``per-layer-std`` (clamp each parameter's
    gradient to ±std_k·σ of that gradient), ``agc`` (adaptive gradient clipping, Brock et al. 2021), ``none``."""
    max_norm: float = allowed(1.0, gt=0)
    """``global-norm`` threshold on the L2 norm of all gradients."""
    std_k: float = allowed(2.5, gt=0)
    """``per-layer-std``: clamp at ±std_k standard deviations of each gradient."""
    agc_lambda: float = allowed(0.01, gt=0)
    """``agc``: the clipping factor λ, the largest allowed ‖G_i‖ / max(‖W_i‖, agc_eps) per unit (row)."""
    agc_eps: float = allowed(1e-3, gt=0)
    """``agc``: floor on the weight norm ε, so zero-initialised units can still move."""

    def __post_init__(self) -> None:
        check_fields(self, "clip")  # method's choices are train.clipping.METHODS (a test keeps them equal)


@dataclass
class NumericsConfig(Frozen):
    """The numerics guard (train/numerics.py): skip non-finite steps, name the culprit, abort."""

    max_bad_steps: int = allowed(10, ge=1)
    """Stop the run (exit code 3) after this many consecutive steps with non-finite loss or gradients."""
    diagnose: bool = True
    """After a bad step, attach forward hooks for the next logging window to name the first module whose
    output is non-finite (hooks are never attached while the run is healthy)."""

    def __post_init__(self) -> None:
        check_fields(self, "numerics")


@dataclass
class TrainConfig(Frozen):
    """The loop: how long, how often to evaluate/log, where to write."""

    max_steps: Optional[int] = allowed(None, ge=1)
    """Optimizer steps to run; None = ``epochs`` full passes over the training split."""
    epochs: float = allowed(1.0, gt=0)
    """Passes over the training split when ``max_steps`` is null."""
    grad_accum: int = allowed(1, ge=1)
    """Micro-batches per optimizer step (gradient accumulation): the step's loss is the sum of per-target losses over
    every micro-batch on every rank divided by their global number of targets (train/accumulation.py)."""
    eval_every: int = allowed(500, ge=1)
    """Evaluate on the validation split every N steps (and always at the end)."""
    log_every: int = allowed(10, ge=1)
    """Write a metrics.jsonl record every N steps (values aggregated over those steps)."""
    eval_before: Optional[bool] = None
    """Evaluate on the validation split before the first step (report.json ``quality.eval_loss_before``, …): true,
    false, or null (auto): yes where the model starts from pretrained weights (``hf:<dir>`` with a weights file)."""
    probe_budget: Optional[float] = allowed(0.1, gt=0, le=1)
    """The share of the run's projected training steps (``max_steps``, or ``epochs`` × the loader's batches) that the
    ``auto`` probes (attention path, chunked loss) may spend as probe steps; a probe past it is not run and its
    decision takes the rule's default, said in the decisions block. null: no limit."""
    seed: int = allowed(0, ge=0, le=2**32 - 1)
    device: str = "auto"
    """``auto`` (CUDA when available, else CPU), ``cpu``, ``cuda``, ``cuda:N``."""
    precision: str = allowed("auto", choices=("auto", "fp32", "bf16", "fp16"))
    """``auto``, ``fp32``, ``bf16``, ``fp16`` (see train/precision.py for what ``auto`` picks and why)."""
    num_threads: Optional[int] = allowed(None, ge=1)
    """torch intra-op threads on CPU; None = torch's default."""
    output_dir: str = "runs"
    run_id: Optional[str] = None
    """Run directory name under ``output_dir``; None = ``<UTC time>-<4 random hex>``, unique without coordination."""
    overwrite: bool = False
    """An explicit ``run_id`` whose directory holds an earlier run is refused unless this is true (then that run's
    report, metrics and checkpoints are removed first) or the command is ``--resume``."""
    progress: bool = True
    """Show tqdm progress bars on a terminal (stderr): training (loss, samples/s, padding %), warm-up and the
    ``bench*`` commands (train/tools/progress.py). Never drawn when stderr is not a TTY."""
    checkpoint_every: Optional[int] = allowed(500, ge=1)
    """Write a resumable checkpoint to ``runs/<id>/checkpoints/`` every N steps; null = only the final
    ``checkpoint.pt``."""
    keep_checkpoints: int = allowed(3, ge=1)
    """How many periodic checkpoints to keep (the newest; older ones are deleted after each write)."""
    shutdown_timeout_s: float = allowed(60.0, gt=0)
    """After SIGTERM/SIGINT the run finishes its step (or abandons its evaluation), checkpoints and reports; it exits
    anyway after this many seconds."""
    resume_apply: Optional[str] = allowed(None, choices=("optim.lr",))
    """``--resume`` refuses settings baked into the checkpoint that differ from it; ``optim.lr`` here applies a new
    peak learning rate for real instead (written into the optimizer's param groups and the scheduler's
    ``base_lrs``; the schedule's shape continues). null = refuse."""

    def __post_init__(self) -> None:
        check_fields(self, "train")
