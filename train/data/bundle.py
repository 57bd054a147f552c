"""From a data source to a :class:`DataBundle`: the prepared splits (cache hit, or read → split → tokenize in bounded
memory, stored), the labels checked, the bucket plan for the configured batching method and the token budget."""

from __future__ import annotations

import errno
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

import train.data.cache as cache  # the modules themselves, not the package: no package <-> submodule import loop
import train.data.causal_prepare as causal_prepare
import train.data.prepare as prepare
from train.config import RunConfig
from train.data.buckets import BucketPlan
from train.data.data_policy import nothing_left, untrainable_at, without
from train.data.sources import Corpus, check_classes
from train.data.tokenizer import TokenizedSplit
from train.errors import UserError
from train.models.external import with_model_tokenizer

BUCKETED = ("optimal", "quantile", "kmeans")


@dataclass
class DataBundle:
    """Everything the trainer needs from the data side."""

    corpus: Corpus
    splits: dict[str, TokenizedSplit]
    tokenizer_info: dict
    vocab_size: int
    pad_id: int
    bounds: list[int]
    pad_to: str
    plan: Optional[BucketPlan]
    plan_source: str
    data_fingerprint: str
    cache: dict = field(default_factory=dict)
    """report.json ``data.cache`` facts: ``cache`` (hit|miss|off), ``cache_dir`` or ``cache_unavailable_reason``."""
    classes_without_training_examples: list = field(default_factory=list)
    """Label names present in validation/test but never in training (warned about; report.json ``data``)."""
    task: str = "classification"
    """``model.task``: ``classification`` (a sample's label is its class) or ``causal-lm`` (a sample's label is its
    ``n_prompt``; train/data/causal_prepare.py); the loaders' collates follow it."""
    bos_id: Optional[int] = None
    """Causal LM: the tokenizer's BOS id (None: it has none); samples start with it iff
    ``tokenizer_info["roles"]["add_bos"]``."""
    eos_id: Optional[int] = None
    """Causal LM: the EOS id every sample ends with (``pad_id`` is EOS's when the tokenizer has no pad token)."""
    data_facts: dict = field(default_factory=dict)
    """Causal LM: what preparation dropped (by cause), cut or split: report.json ``data``
    (train/data/data_policy.py)."""

    @property
    def num_classes(self) -> int:
        return self.corpus.num_classes


def bucket_plan(cfg: RunConfig, lengths: np.ndarray, data_fp: str, tok_fp: str, run_dir: Optional[Path],
                force: bool, notice: Callable[[str], None]) -> tuple[list[int], str, Optional[BucketPlan], str]:
    """(bounds, pad_to, plan, source) for the configured batching method.

    ``pad-to-max`` → one bucket at ``max_len``; ``random`` → one bucket, padded to the batch max;
    bucketed methods (padded to ``batching.pad_to``) → the plan from ``batching.boundaries_file`` (fingerprints checked
    unless ``force``), or fitted now and saved as ``<run_dir>/buckets.json`` where the run has none yet.
    """
    b = cfg.batching
    if b.method == "pad-to-max":
        return [cfg.data.max_len], "bound", None, "none (pad to data.max_len)"
    if b.method == "random":
        return [cfg.data.max_len], "batch-max", None, "none (random batches, pad to batch max)"
    if b.method == "hf-group-by-length":
        return [cfg.data.max_len], "batch-max", None, "none (megabatch length grouping, pad to batch max)"
    if b.method == "packed":  # training: packed rows of pack_len; evaluation: batches padded to their longest sample
        c = b.pack_len or cfg.data.max_len
        longer = int((np.asarray(lengths) > c).sum())
        cut = (f"; {longer} training samples longer than {c} tokens are truncated to it (kept, counted in report.json "
               "batching.truncated_in_collate; raise batching.pack_len to keep them whole)") if longer else ""
        return [c], "batch-max", None, f"none (sequence packing into rows of {c} tokens{cut})"
    if b.boundaries_file:
        plan = BucketPlan.load(b.boundaries_file, data_fp, tok_fp, force=force)
        return plan.bounds, b.pad_to, plan, str(b.boundaries_file)
    method = "optimal" if b.method == "auto" else b.method  # auto plans optimal buckets until it has measured
    plan = BucketPlan.fit(lengths, b.num_buckets, method, b.round_to, cfg.data.max_len, data_fp, tok_fp)
    source = "fitted on the fly"
    if run_dir is not None:
        if not (run_dir / "buckets.json").exists():  # a resume's is its run's (a refused resume leaves it as it was)
            plan.save(run_dir / "buckets.json")
        source = str(run_dir / "buckets.json")
    where = f"saved to {source}" if run_dir is not None else "not saved"
    pending = (" (batching.method=auto: the plan if the measurement picks buckets over packing)"
               if b.method == "auto" else "")
    notice(f"no batching.boundaries_file: fitted {method} buckets {plan.bounds} on the fly "
           f"(predicted token efficiency {plan.predicted_token_efficiency:.3f}); {where}{pending}")
    return plan.bounds, b.pad_to, plan, source


def check_token_budget(max_tokens: Optional[int], bounds: list[int], max_len: int) -> None:
    """A batch is at least one sample and never more than ``max_tokens`` padded tokens, so the budget
    must hold one sample of the longest bucket. (With a budget, ``batching.batch_size`` is not used.)

    Raises:
        UserError: ``max_tokens`` < the largest bucket bound.
    """
    if max_tokens is not None and max_tokens < max(bounds):
        raise UserError(f"batching.max_tokens={max_tokens} cannot hold one sample of the longest bucket "
                        f"({max(bounds)} tokens, data.max_len={max_len}): every batch would exceed the token budget; "
                        f"raise batching.max_tokens to at least {max(bounds)} or lower data.max_len")


def _build(cfg: RunConfig, entry: Optional[Path] = None) -> cache.Prepared:
    """Read, split and tokenize the configured source in bounded memory (train/data/prepare.py): into the cache
    entry ``entry`` (a temporary directory named after this process, renamed into place), or without one into a
    scratch directory that is removed once its files are memory-mapped (they stay readable until unmapped)."""
    if entry is not None:
        tmp = cache.writer_dir(entry.parent, f".{entry.name}.")
    else:
        scratch_root = Path(tempfile.gettempdir())
        cache.remove_dead_writers(scratch_root, _SCRATCH)
        try:
            tmp = cache.writer_dir(scratch_root, "deep-model-perf-prepare.")
        except OSError as exc:
            raise _scratch_error(scratch_root, exc) from None
    try:
        tok_info = (causal_prepare.build if cfg.model.task == "causal-lm" else prepare.build)(cfg, tmp)
        if entry is not None:
            cache.publish(tmp, entry)
        built = cache.load(entry if entry is not None else tmp)
        if built is None:
            raise OSError(f"the prepared data just written to {entry or tmp} cannot be read back")
    except OSError as exc:
        if entry is None and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES) \
                and (exc.filename is None or str(exc.filename).startswith(str(tmp))):
            raise _scratch_error(tmp.parent, exc) from None
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    built.tokenizer_info = tok_info  # where the tokenizer came from (trained, cache-hit, user), not the entry's copy
    return built


def _scratch_error(where: Path, exc: OSError) -> UserError:
    return UserError(f"cannot write the prepared data to {where} ({exc.strerror or exc}); free space there or point "
                     "TMPDIR at a disk with room (or fix data.cache_dir, where it is normally kept)")


_SCRATCH = re.compile(r"deep-model-perf-prepare\.(?P<pid>\d+)-(?P<ns>\d+)@(?P<host>.+)\.[a-z0-9_]{8}")


def prepare_splits(cfg: RunConfig) -> cache.Prepared:
    """The corpus and its tokenized splits: from the prepared-data cache when an entry exists for this source
    content and these settings (train/data/cache.py), else built in bounded memory and stored.
    ``data.cache_prepared=false`` always builds. A ``model.source=hf:<dir>`` without ``data.tokenizer_path`` reads
    the directory's own tokenizer (:func:`~train.models.external.with_model_tokenizer`). Raises UserError for any bad
    input."""
    cfg = with_model_tokenizer(cfg)
    d = cfg.data
    if not d.cache_prepared:
        return _with_cache(_build(cfg), {"cache": "off", "cache_unavailable_reason": "data.cache_prepared=false"})
    source_sha, why = cache.source_fingerprint(d)
    user_tok = cache.user_tokenizer_fingerprint(d.tokenizer_path)
    if d.tokenizer_path is not None and user_tok is None:
        why = why or f"data.tokenizer_path={d.tokenizer_path!r} cannot be read"
    if why is not None:
        return _with_cache(_build(cfg), {"cache": "off", "cache_unavailable_reason": why})
    causal = causal_prepare.lm_cache_parts(cfg) if cfg.model.task == "causal-lm" else None
    entry = Path(d.cache_dir) / "data" / cache.cache_key(d, source_sha, user_tok, causal)
    cache.remove_dead_writers(entry.parent)  # what a killed writer left behind
    hit = cache.load(entry)
    if hit is not None:
        if hit.tokenizer_info.get("source") == "trained":
            hit.tokenizer_info = {**hit.tokenizer_info, "source": "cache-hit"}
        return _with_cache(hit, {"cache": "hit", "cache_dir": str(entry)})
    facts: dict = {"cache": "miss", "cache_dir": str(entry)}
    try:
        built = _build(cfg, entry)
    except OSError as exc:  # an unwritable cache costs a rebuild next time, nothing more
        facts["cache_unavailable_reason"] = f"not written: {exc.strerror or exc}"
        built = _build(cfg)
    return _with_cache(built, facts)


def _with_cache(p: cache.Prepared, facts: dict) -> cache.Prepared:
    p.cache = facts
    return p


def prepare_data(cfg: RunConfig, run_dir: Optional[Path] = None, buckets_force: bool = False,
                 notice: Callable[[str], None] = print) -> DataBundle:
    """Load (or reuse), split, tokenize and plan the buckets. Raises UserError for any bad input."""
    p = prepare_splits(cfg)
    task, roles = cfg.model.task, p.tokenizer_info.get("roles") or {}
    data_facts = dict(p.data_facts)
    if task == "causal-lm":  # no classes; the samples left out, cut or split said once
        unseen: list = []
        pack_len = _drop_untrainable_packed(cfg, p, data_facts)
        for line in causal_prepare.data_notices(data_facts, cfg.data.max_len, pack_len):
            notice(line)
    else:
        unseen = check_classes({name: p.corpus.split(name).labels for name in ("train", "validation", "test")},
                               p.corpus.label_names, notice)
    bounds, pad_to, plan, source = bucket_plan(cfg, p.splits["train"].lengths, p.data_fingerprint,
                                               p.tokenizer_info["fingerprint"], run_dir, buckets_force, notice)
    check_token_budget(cfg.batching.max_tokens, bounds, cfg.data.max_len)
    return DataBundle(corpus=p.corpus, splits=p.splits, tokenizer_info=p.tokenizer_info, vocab_size=p.vocab_size,
                      pad_id=p.pad_id, bounds=bounds, pad_to=pad_to, plan=plan, plan_source=source,
                      data_fingerprint=p.data_fingerprint, cache=p.cache, classes_without_training_examples=unseen,
                      task=task, bos_id=roles.get("bos_id"), eos_id=roles.get("eos_id"), data_facts=data_facts)


def _drop_untrainable_packed(cfg: RunConfig, p: cache.Prepared, data_facts: dict) -> Optional[int]:
    """Packed rows of ``batching.pack_len`` tokens: leave out of the training split the samples that would have no
    trained target once cut to it (a prompt that fills the row), so no optimizer step trains nothing; counted in
    ``data_facts`` (``no_target_at_pack_len``). Returns the ``pack_len`` that applies, or None.

    Raises:
        UserError: no training sample keeps a target at ``pack_len`` (the setting named before any step).
    """
    b = cfg.batching
    if b.method not in ("packed", "auto") or b.pack_len is None or b.pack_len >= cfg.data.max_len:
        return None
    train = p.splits["train"]
    drop = untrainable_at(train, b.pack_len)
    if not drop.any():
        return b.pack_len
    counts = {**data_facts.get("dropped_rows", {}), "no_target_at_pack_len": int(drop.sum())}
    if drop.all():
        raise nothing_left(counts, f"batching.pack_len={b.pack_len}", cfg.data.max_len, b.pack_len)
    p.splits = {**p.splits, "train": without(train, drop)}
    data_facts["dropped_rows"] = counts
    return b.pack_len


def fit_bucket_plan(cfg: RunConfig) -> BucketPlan:
    """Fit ``batching.num_buckets`` bounds with ``batching.method`` on the training split's lengths, offline
    (``python -m train buckets``); the plan carries the data and tokenizer fingerprints it was fitted on.

    Raises:
        UserError: a batching method without buckets, or bad data.
    """
    b = cfg.batching
    method = "optimal" if b.method == "auto" else b.method  # auto may train on buckets: plan the optimal ones
    if method not in BUCKETED:
        raise UserError(f"batching.method={b.method!r} uses no buckets; choose one of {', '.join(BUCKETED)}")
    p = prepare_splits(cfg)
    return BucketPlan.fit(p.splits["train"].lengths, b.num_buckets, method, b.round_to, cfg.data.max_len,
                          p.data_fingerprint, p.tokenizer_info["fingerprint"])
