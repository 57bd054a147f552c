"""Packed rows (``batching.method=packed``) for Hugging Face encoders and ``python:`` models that declare them.

A packed batch holds several samples back to back in each row of ``C`` tokens (train/data/packing.py): ``input_ids``
[R, C], ``position_ids`` [R, C] (0, 1, … within each sample), ``seq_index`` [R, C] (the sample's label slot, -1 for
padding) and ``num_seqs`` label slots. A Hugging Face encoder runs it exactly like the samples one by one:

* **positions**: each sample's own, plus the architecture's offset (RoBERTa-family embeddings count from
  ``pad_token_id + 1``);
* **attention**: a block-diagonal mask — token i attends to token j only within the same sample (padding attends
  to itself, so no row is empty) — given to the base model as a 4-D boolean mask [R, 1, C, C] (transformers ≥ 5) or
  a 3-D 0/1 mask [R, C, C] (transformers 4.x ``get_extended_attention_mask``), whichever the installed version takes;
* **classification**: every sample's first token (``[CLS]`` / ``<s>``) gathered from the base model's hidden states
  into [num_seqs, H] and put through the model's own head: BERT's pooler (dense + tanh), dropout and classifier;
  RoBERTa / XLM-RoBERTa / CamemBERT / ELECTRA's classification head; DistilBERT's pre-classifier, ReLU, dropout and
  classifier. Empty label slots get zero features (their labels are ignored by the loss).

Whether it is exact is not assumed: :func:`probe_packing` runs two short random samples packed and one by one (fp32,
eval mode, no grad, RNG untouched) and enables packing only when the logits agree to 1e-5; otherwise the model
keeps ``supports_packing = False`` with a one-line reason (an architecture without a known head, a forward that
rejects ``position_ids`` or the block mask, logits that differ).

A ``python:`` model declares packing with a ``supports_packing = True`` attribute on the module; its forward is then
also called as ``forward(input_ids, attention_mask, position_ids=, seq_index=, num_seqs=)`` and must return
FloatTensor[num_seqs, num_classes] (checked once at build time: another shape is one line, exit 2).
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch
from torch import nn

from train.errors import UserError

HEADS = {"bert": "pooler", "roberta": "classification-head", "xlm-roberta": "classification-head",
         "camembert": "classification-head", "electra": "classification-head", "distilbert": "pre-classifier"}
"""model_type → how its sequence classifier reads the first token (see the module docstring)."""
POSITION_FROM_PAD = ("roberta", "xlm-roberta", "camembert")
EXACT_ATOL = 1e-5


def block_mask(seq_index: torch.Tensor) -> torch.Tensor:
    """BoolTensor[R, C, C]: True where token i may attend to token j (same sample; a padding token to itself)."""
    same = (seq_index[:, :, None] == seq_index[:, None, :]) & (seq_index[:, None, :] >= 0)
    eye = torch.eye(seq_index.shape[1], dtype=torch.bool, device=seq_index.device)
    return same | (eye & (seq_index[:, :, None] < 0))


def first_tokens(hidden: torch.Tensor, position_ids: torch.Tensor, seq_index: torch.Tensor,
                 num_seqs: int) -> torch.Tensor:
    """[num_seqs, H]: each sample's first-token hidden state (slot ``seq_index``), zeros for empty slots."""
    starts = (position_ids == 0) & (seq_index >= 0)
    slots = seq_index[starts]
    out = hidden.new_zeros(num_seqs, hidden.shape[-1])
    return out.index_copy(0, slots, hidden[starts])


def _head(inner: nn.Module, model_type: str, feats: torch.Tensor) -> torch.Tensor:
    style = HEADS[model_type]
    if style == "pooler":
        pooler = getattr(inner, inner.base_model_prefix).pooler
        return inner.classifier(inner.dropout(pooler.activation(pooler.dense(feats))))
    if style == "pre-classifier":
        return inner.classifier(inner.dropout(torch.relu(inner.pre_classifier(feats))))
    return inner.classifier(feats[:, None, :])  # the head reads features[:, 0, :]


def hf_packed_logits(inner: nn.Module, model_type: str, mask_dim: int, input_ids: torch.Tensor,
                     position_ids: torch.Tensor, seq_index: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """Logits [num_seqs, num_labels] of a Hugging Face sequence classifier on a packed batch (module docstring)."""
    config = inner.config
    offset = (config.pad_token_id + 1) if model_type in POSITION_FROM_PAD else 0
    mask = block_mask(seq_index)
    mask = mask[:, None] if mask_dim == 4 else mask.long()
    base = getattr(inner, inner.base_model_prefix)
    hidden = base(input_ids=input_ids, attention_mask=mask, position_ids=position_ids + offset)[0]
    return _head(inner, model_type, first_tokens(hidden, position_ids, seq_index, num_seqs))


def takes_position_ids(model_type: str) -> Optional[str]:
    """None when the installed transformers' base model for ``model_type`` takes ``position_ids``, else why not
    (looked up from the class, nothing built)."""
    try:
        import transformers as tf  # here, not train.models.hf: that module imports the wrapper, which imports this one
    except ImportError:
        return "the transformers package is not installed"
    names = getattr(tf.models.auto.modeling_auto, "MODEL_MAPPING_NAMES", {})
    cls = getattr(tf, names.get(model_type, ""), None)
    if cls is None:
        return f"transformers {tf.__version__} has no base model for {model_type}"
    if "position_ids" not in inspect.signature(cls.forward).parameters:
        return f"{cls.__name__}.forward takes no position_ids in transformers {tf.__version__}"
    return None


def _sample_batch(vocab: int, device: torch.device) -> tuple[list[torch.Tensor], dict[str, Any]]:
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, max(4, vocab), (n,), generator=gen) for n in (5, 3)]
    c = sum(len(s) for s in seqs) + 2  # two padding tokens at the end
    ids, pos, seq = (torch.zeros(1, c, dtype=torch.long), torch.zeros(1, c, dtype=torch.long),
                     torch.full((1, c), -1, dtype=torch.long))
    at = 0
    for k, s in enumerate(seqs):
        ids[0, at:at + len(s)], pos[0, at:at + len(s)], seq[0, at:at + len(s)] = s, torch.arange(len(s)), k
        at += len(s)
    batch = {"input_ids": ids.to(device), "attention_mask": (seq >= 0).to(device), "position_ids": pos.to(device),
             "seq_index": seq.to(device), "num_seqs": len(seqs) + 1}  # one empty label slot
    return [s.to(device) for s in seqs], batch


@torch.no_grad()
def probe_packing(wrapper: Any) -> tuple[bool, str]:
    """Try packed rows on ``wrapper`` (an :class:`~train.models.wrap.ExternalClassifier`) and set its
    ``supports_packing``, ``packing_reason`` and mask format. Returns ``(supported, reason)``.

    Raises:
        UserError: a ``python:`` model that declares ``supports_packing`` but returns another shape than
            [num_seqs, num_classes] for a packed batch (naming the model and what it returned).
    """
    inner = wrapper.inner
    device = next(inner.parameters()).device
    seqs, batch = _sample_batch(wrapper.spec.vocab_size, device)
    was_training = inner.training
    inner.eval()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            if wrapper.kind == "python":
                return _check_python(wrapper, seqs, batch)
            return _check_hf(wrapper, seqs, batch)
    finally:
        inner.train(was_training)


def _check_python(wrapper: Any, seqs: list[torch.Tensor], batch: dict) -> tuple[bool, str]:
    inner, source = wrapper.inner, wrapper.spec.source
    if not getattr(inner, "supports_packing", False):
        return wrapper.set_packing(False, f"model.source={source} ({type(inner).__name__}) declares no packed rows "
                                          "(set supports_packing = True on the module; docs/models.md)")
    n = batch["num_seqs"]
    try:
        out = inner(batch["input_ids"], batch["attention_mask"], position_ids=batch["position_ids"],
                    seq_index=batch["seq_index"], num_seqs=n)
    except Exception as exc:  # noqa: BLE001 - the user's forward: one line
        raise UserError(f"model.source={source}: declares supports_packing but its packed forward failed "
                        f"({type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}); see the "
                        "python: contract in docs/models.md") from None
    shape = tuple(getattr(out, "shape", ()))
    if shape != (n, wrapper.spec.num_classes):
        raise UserError(f"model.source={source}: declares supports_packing but returned "
                        f"{shape or type(out).__name__} for a packed batch of {n} label slots; expected "
                        f"({n}, {wrapper.spec.num_classes}): one row of logits per slot (seq_index numbers them)")
    return wrapper.set_packing(True, "declared by the module (supports_packing = True), shape checked")


def _check_hf(wrapper: Any, seqs: list[torch.Tensor], batch: dict) -> tuple[bool, str]:
    inner = wrapper.inner
    model_type = getattr(inner.config, "model_type", "?")
    arch = f"{type(inner).__name__} (model_type {model_type})"
    if model_type not in HEADS:
        return wrapper.set_packing(False, f"{arch}: no known pooling path for packed rows (packed: "
                                          f"{', '.join(sorted(HEADS))})")
    why = takes_position_ids(model_type)
    if why is not None:
        return wrapper.set_packing(False, f"{arch}: {why}")
    ref = torch.cat([inner(input_ids=s[None], attention_mask=torch.ones_like(s)[None]).logits for s in seqs])
    errors = []
    for dim in (4, 3):
        try:
            got = hf_packed_logits(inner, model_type, dim, batch["input_ids"], batch["position_ids"],
                                   batch["seq_index"], batch["num_seqs"])
        except (TypeError, ValueError, RuntimeError) as exc:
            errors.append(f"{dim}-D mask: {type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''}")
            continue
        gap = float((got[: len(seqs)].float() - ref.float()).abs().max())
        if gap <= EXACT_ATOL:
            wrapper.mask_dim = dim
            return wrapper.set_packing(True, f"{arch}: per-sample positions, a {dim}-D block-diagonal mask and each "
                                             f"sample's first token through the model's own head (max logit gap "
                                             f"{gap:.1e} vs unpacked)")
        errors.append(f"{dim}-D mask: logits differ from unpacked by {gap:.1e}")
    return wrapper.set_packing(False, f"{arch}: packed rows are not exact here ({'; '.join(errors)})")
