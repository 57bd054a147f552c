"""A trained model in its ecosystem's format: ``runs/<id>/model/``, loadable by transformers, peft and any tool
that reads a Hugging Face model directory (vLLM, text-generation-inference, a model hub).

* full fine-tuning: ``config.json`` + ``model.safetensors`` (``save_pretrained``), ``generation_config.json`` for a
  decoder (its BOS / EOS / pad ids), and the tokenizer (``tokenizer.json`` + ``tokenizer_config.json`` +
  ``special_tokens_map.json`` through ``PreTrainedTokenizerFast``, the roles set: bos / eos / pad, and a
  classifier's WordPiece ``[CLS]`` / ``[SEP]`` / ``[UNK]`` / ``[MASK]``), so ``AutoModelFor….from_pretrained(dir)`` +
  ``AutoTokenizer.from_pretrained(dir)`` give the run's logits and token ids;
* an adapter run (``model.adapter``): peft's own layout (``adapter_config.json`` + ``adapter_model.safetensors``,
  ``PeftModel.from_pretrained(base, dir)``) and the tokenizer; the base is the source directory when it has
  weights, else the random-init base written to ``<dir>/base/`` (its ``adapter_config.json`` points there);
  ``merged=True``: ``merge_and_unload`` into a plain model directory instead.

Every directory is written beside its final place and renamed into it (:func:`atomic_dir`): a reader never sees
half of one, and an export that fails leaves the previous one as it was.
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

from torch import nn

from train.errors import UserError, process_alive

WORDPIECE_ROLES = {"unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]",
                   "mask_token": "[MASK]"}
"""The trained WordPiece tokenizer's special tokens (train/data/tokenizer.py) by transformers' role names."""


MARKER = ".deep-model-perf-export"
"""An empty file in every export directory: the only kind of existing directory an export replaces."""


def check_target(path: Path) -> None:
    """Refuse to write an export over anything but an earlier export (or an empty directory).

    Raises:
        UserError: ``path`` is a file, or a non-empty directory without :data:`MARKER` (it would be replaced)."""
    if path.is_file() or (path.exists() and not path.is_dir()):
        raise UserError(f"export: {path} is a file, not a directory; choose another --out")
    if path.is_dir() and any(path.iterdir()) and not (path / MARKER).is_file():
        raise UserError(f"export: {path} exists and is not an earlier export (no {MARKER} in it): nothing was "
                        "written; choose a new or empty --out directory")


@contextlib.contextmanager
def atomic_dir(path: Path) -> Iterator[Path]:
    """A temporary directory beside ``path``, renamed to ``path`` when the block ends without an error (an existing
    ``path``, an earlier export, is replaced only then); removed on an error. Files and directories get the modes
    the umask gives (mkdtemp's 0700, safetensors' 0600 otherwise: a server running as another user could not read
    the weights).

    Raises:
        UserError: ``path`` is not a place for an export (:func:`check_target`), or cannot be written there."""
    check_target(path)
    umask = os.umask(0)
    os.umask(umask)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        recover_dead_exports(path)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp", dir=path.parent))
    except OSError as exc:
        raise UserError(f"export: cannot write {path} ({exc.strerror or exc}); choose another --out") from None
    try:
        yield tmp
        (tmp / MARKER).touch()
        for p in [tmp, *tmp.rglob("*")]:
            p.chmod((0o777 if p.is_dir() else 0o666) & ~umask)
        old = None
        if path.exists():
            old = path.parent / f".{path.name}.old-{os.getpid()}"
            os.replace(path, old)
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except OSError as exc:
        raise UserError(f"export: cannot write {path} ({exc.strerror or exc}); nothing was replaced") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def recover_dead_exports(path: Path) -> list[str]:
    """What an export to ``path`` killed by a signal left beside it (each names its process: ``.<name>.<pid>.*.tmp``,
    ``.<name>.old-<pid>``), for processes no longer alive: a half-written temporary directory is removed; the
    previous export moved aside just before the kill is put back when nothing replaced it, else removed. Returns
    what was done, a line each (said on stderr)."""
    done = []
    for p in sorted(path.parent.glob(f".{path.name}.*")):
        rest = p.name[len(path.name) + 2:]
        pid = rest[4:] if rest.startswith("old-") else rest.split(".")[0] if p.name.endswith(".tmp") else ""
        if not pid.isdigit() or process_alive(int(pid)):
            continue
        if rest.startswith("old-") and not path.exists():
            os.replace(p, path)
            done.append(f"restored the previous export {path} from {p.name}")
        else:
            shutil.rmtree(p, ignore_errors=True)
            done.append(f"removed {p.name}, left by a killed export")
    for line in done:
        print(f"notice: export: {line}", file=sys.stderr)
    return done


def special_tokens(bundle: Any) -> dict[str, Optional[int]]:
    """The ids the run's samples were built with: ``bos_id`` / ``eos_id`` (a causal LM's) and ``pad_id``."""
    return {"bos_id": getattr(bundle, "bos_id", None), "eos_id": getattr(bundle, "eos_id", None),
            "pad_id": getattr(bundle, "pad_id", None)}


def source_files(source: str, inner: nn.Module) -> dict[str, Any]:
    """What the export keeps of the source model: its chat template, its own ``model_max_length`` (the source
    tokenizer's, else the config's ``max_position_embeddings``; never the run's ``data.max_len``) and its dtype
    (``fp32`` | ``bf16`` | ``fp16``: config.json's ``torch_dtype`` / ``dtype``; fp32 for a random init)."""
    import json

    from train.config.source import source_kind
    from train.models.library import TEMPLATE_FILES

    d = Path(source[3:]).expanduser() if source.startswith("hf:") and source_kind(source) == "hf-dir" else None

    def read(name: str) -> dict:
        try:
            return json.loads((d / name).read_text(encoding="utf-8")) if d is not None else {}
        except (OSError, ValueError):
            return {}

    tc, config = read("tokenizer_config.json"), read("config.json")
    template = (d / TEMPLATE_FILES[0]).read_text(encoding="utf-8") if d is not None and \
        (d / TEMPLATE_FILES[0]).is_file() else tc.get("chat_template")
    positions = getattr(getattr(inner, "config", None), "max_position_embeddings", None)
    own = tc.get("model_max_length")
    max_length = int(own) if isinstance(own, (int, float)) and own < 10**9 else positions
    dtype = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(
        str(config.get("torch_dtype") or config.get("dtype") or "float32"), "fp32")
    return {"chat_template": template, "model_max_length": max_length, "dtype": dtype}


def save_tokenizer(tokenizer_json: Path, out: Path, ids: dict[str, Optional[int]], max_len: int,
                   causal: bool = False, chat_template: Optional[str] = None) -> None:
    """``tokenizer_json`` (the run's tokenizers file) as a transformers fast tokenizer in ``out``, with its roles:
    bos / eos / pad from ``ids`` (a causal LM's; pad = EOS where the tokenizer has no pad token), and the
    WordPiece specials where the vocabulary has them; ``model_max_length`` = ``max_len`` (the model's own); the
    source's ``chat_template``; a decoder's pads on the left (``generate`` continues each row from its last
    token)."""
    from tokenizers import Tokenizer

    from train.models.library import import_transformers

    tf = import_transformers()
    backend = Tokenizer.from_file(str(tokenizer_json))
    roles: dict[str, str] = {role: tok for role, tok in WORDPIECE_ROLES.items()
                             if backend.token_to_id(tok) is not None}
    for role in ("bos", "eos", "pad"):
        i = ids.get(f"{role}_id")
        if i is not None and backend.id_to_token(int(i)) is not None:
            roles[f"{role}_token"] = backend.id_to_token(int(i))
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=backend, model_max_length=max_len,
                                      padding_side="left" if causal else "right", **roles)
    if chat_template:
        fast.chat_template = chat_template
    fast.save_pretrained(str(out))


def _generation_config(inner: nn.Module, ids: dict[str, Optional[int]]) -> None:
    """A decoder's ``generation_config``: the run's EOS ends generation, its pad pads batches."""
    gen = getattr(inner, "generation_config", None)
    if gen is None:
        return
    for key in ("bos_id", "eos_id", "pad_id"):
        if ids.get(key) is not None:
            setattr(gen, key.replace("_id", "_token_id"), int(ids[key]))


def _save_plain(inner: nn.Module, out: Path, ids: dict[str, Optional[int]], causal: bool) -> None:
    if causal:
        _generation_config(inner, ids)
    inner.save_pretrained(str(out), safe_serialization=True)


def export_model(wrapper: nn.Module, out: Path, tokenizer_json: Optional[Path], ids: dict[str, Optional[int]],
                 merged: bool = False, dtype: Optional[str] = None, report: Optional[dict] = None) -> dict[str, Any]:
    """Write ``wrapper``'s transformers model (an :class:`~train.models.wrap.ExternalClassifier` or
    :class:`~train.models.causal.ExternalCausalLM` of a ``hf:`` source) to ``out`` (module docstring) in ``dtype``
    (``fp32`` | ``bf16`` | ``fp16``; None: the base's own, :func:`source_files`; an adapter's own weights stay fp32),
    with the source's chat template and ``model_max_length`` and a model card (``README.md``,
    train/models/model_card.py, from ``report``). The live model is not changed: an adapter is unloaded or merged
    on a copy, a cast is made on a copy. Returns report.json's ``export`` block: ``path``, ``format``
    (``transformers``, ``peft-adapter`` or ``merged``), ``files``, ``base`` (as the run gave it), ``dtype``.

    Raises:
        UserError: the model does not come from transformers (``python:`` or the built-in encoder).
    """
    inner = getattr(wrapper, "inner", None)
    if inner is None or not hasattr(inner, "save_pretrained") or getattr(wrapper, "kind", "hf") != "hf":
        raise UserError(f"export: model.source={getattr(getattr(wrapper, 'spec', None), 'source', 'builtin')} is not "
                        "a Hugging Face model: only hf:<dir> / hf:<model_type> runs export a model directory")
    causal = getattr(wrapper.spec, "task", "classification") == "causal-lm"
    peft_model = getattr(wrapper, "peft_model", None)
    base: Optional[str] = None
    keep = source_files(wrapper.spec.source, inner)
    dtype = dtype or keep["dtype"]
    with atomic_dir(out) as tmp:
        if peft_model is None:
            fmt = "transformers"
            _save_plain(_cast(inner, dtype), tmp, ids, causal)
        elif merged:
            fmt = "merged"
            _save_plain(_cast(_fp32_copy(peft_model).merge_and_unload(), dtype), tmp, ids, causal)
        else:
            fmt = "peft-adapter"
            # the base as the run gave it (a relative path or a hub id), never this machine's absolute path
            base = wrapper.spec.source[3:] if _base_path(wrapper.spec.source) else None
            if base is None:  # a random-init base exists nowhere else: it travels with the adapter
                base = str(out / "base")
                _save_plain(_cast(_fp32_copy(peft_model).unload(), dtype), tmp / "base", ids, causal)
            peft_model.peft_config["default"].base_model_name_or_path = base
            with warnings.catch_warnings():  # peft looks for the base's config at ``base``, written by the rename
                warnings.simplefilter("ignore")
                peft_model.save_pretrained(str(tmp))
        if tokenizer_json is not None and Path(tokenizer_json).is_file():
            save_tokenizer(Path(tokenizer_json), tmp, ids, int(keep["model_max_length"] or wrapper.spec.max_len),
                           causal, keep["chat_template"])
        from train.models.model_card import card_text

        (tmp / "README.md").write_text(card_text(wrapper.spec.source, fmt, dtype, report), encoding="utf-8")
        files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file() and p.name != MARKER)
    return {"path": str(out), "format": fmt, "files": files, "base": base, "dtype": dtype}


def _cast(model: nn.Module, dtype: str) -> nn.Module:
    """``model`` itself in fp32, else a copy in ``dtype`` (the live model keeps its fp32 weights)."""
    import torch

    want = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    if all(p.dtype == want for p in model.parameters()):
        return model
    return copy.deepcopy(model).to(want)


def _fp32_copy(peft_model: nn.Module) -> nn.Module:
    """A copy of the PeftModel in fp32: a bf16 / fp16 run holds its frozen base in the compute dtype
    (train.models.adapter.hold_frozen_base); the adapter merges into, and the base is saved as, fp32 weights."""
    return copy.deepcopy(peft_model).float()


def _base_path(source: str) -> Optional[str]:
    """The directory of an ``hf:<dir>`` source that has weights (the adapter's base), else None."""
    from train.models.external import has_pretrained_weights

    return str(Path(source[3:]).expanduser().absolute()) if has_pretrained_weights(source) else None


def model_from_checkpoint(state: dict[str, Any], where: str) -> nn.Module:
    """The wrapped model of a run's checkpoint (``state`` from ``load_checkpoint``), rebuilt from its spec (the
    Hugging Face config as JSON) with the checkpoint's weights — for an adapter run, the base rebuilt as the run built
    it (the source directory's weights, or the random init of ``train.seed``), checked against the spec's
    ``base_fingerprint``, and the adapter loaded on it.

    Raises:
        UserError: not a checkpoint of a ``hf:`` model, a base other than the one the adapter was trained on, an
            adapter that does not fit.
    """
    import json

    import torch

    from train.compat import hf_attn_implementation
    from train.config.adapter import parse_adapter
    from train.models.adapter import attach_adapter, base_fingerprint, load_model_state
    from train.models.causal import ExternalCausalLM
    from train.models.library import import_transformers
    from train.models.wrap import ExternalClassifier, ExternalSpec

    raw_spec = state.get("spec")
    source = raw_spec.get("source") if isinstance(raw_spec, dict) else None
    source = source or ((state.get("config") or {}).get("model") or {}).get("source") or "builtin"
    if not isinstance(raw_spec, dict) or not raw_spec.get("hf_config") or not isinstance(state.get("model"), dict):
        raise UserError(f"{where}: not a checkpoint of a Hugging Face model (model.source={source}); only "
                        "hf:<dir> / hf:<model_type> runs export a model directory")
    known = set(ExternalSpec.__dataclass_fields__)
    try:
        spec = ExternalSpec(**{"num_classes": 0, **{k: v for k, v in raw_spec.items() if k in known}})
    except TypeError:
        raise UserError(f"{where}: its spec lacks fields a model checkpoint of this project has (source, "
                        "vocab_size, max_len): not a complete checkpoint of this project") from None
    tf = import_transformers()
    try:
        raw = json.loads(spec.hf_config)
        config = tf.AutoConfig.for_model(raw.pop("model_type"), **raw)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise UserError(f"{where}: its spec.hf_config is not a transformers config this version reads "
                        f"({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})") from None
    causal = spec.task == "causal-lm"
    auto = tf.AutoModelForCausalLM if causal else tf.AutoModelForSequenceClassification
    settings = parse_adapter(json.loads(spec.adapter)) if spec.adapter else None
    if settings is not None:
        torch.manual_seed(int((state.get("config") or {}).get("train", {}).get("seed", 0)))
    base = _base_path(spec.source) if settings is not None else None
    attn = {"attn_implementation": hf_attn_implementation()}
    inner = auto.from_pretrained(base, config=config, local_files_only=True, **attn) if base else \
        auto.from_config(config, **attn)
    if settings is not None:
        have = base_fingerprint(inner)
        if have != spec.base_fingerprint:
            raise UserError(f"{where}: its adapter was trained on another base (content {spec.base_fingerprint}, "
                            f"{spec.source} gives {have} now); export on the base the run trained on")
    wrapper = ExternalCausalLM(inner, spec, "hf") if causal else ExternalClassifier(inner, spec, "hf")
    if settings is not None:
        wrapper.adapter_info = attach_adapter(wrapper, settings, config.model_type)
    load_model_state(wrapper, state["model"], where)
    return wrapper.eval()
