"""Shared fixtures and helpers: small data the tests write themselves (a WNDB directory, JSONL/CSV files), a tiny
trainer and batch, host-read counting, the CLI in a subprocess, resume comparison, multi-process (DDP) helpers.

Every helper more than one test module uses lives here: a test module never imports another test module
(``tests/test_structure.py`` checks). Imports of ``train`` modules beyond ``train.config`` are inside the helpers.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
import torch.multiprocessing as mp
from torch.overrides import TorchFunctionMode

from train.compat import fsdp2_api, hf_attn_implementation
from train.config import load_config

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from train.precision import PrecisionPolicy
    from train.trainer import Trainer

HEADER = "  1 This software and database is being provided to you, the LICENSEE, by  \n"

# Words that make each class learnable from the gloss alone.
CLASS_WORDS = {
    ("noun", "n", 5): ["animal", "mammal", "bird", "fur", "tail", "species"],  # noun.animal
    ("noun", "n", 6): ["tool", "device", "machine", "metal", "handle", "built"],  # noun.artifact
    ("verb", "v", 38): ["move", "walk", "run", "travel", "go", "fast"],  # verb.motion
    ("adj", "a", 0): ["good", "bad", "large", "small", "quality", "having"],  # adj.all
}


def write_wndb(root: Path, rows: list[tuple[str, str, int, list[str], str]]) -> Path:
    """Write data.noun/verb/adj/adv with real byte offsets. rows: (file, ss_type, lex_filenum, words, gloss)."""
    root.mkdir(parents=True, exist_ok=True)
    by_file: dict[str, list] = {"noun": [], "verb": [], "adj": [], "adv": []}
    for row in rows:
        by_file[row[0]].append(row)
    for pos_file, items in by_file.items():
        out = HEADER
        for _, ss_type, lex, words, gloss in items:
            offset = len(out.encode())
            word_part = " ".join(f"{w} 0" for w in words)
            out += f"{offset:08d} {lex:02d} {ss_type} {len(words):02x} {word_part} 000 | {gloss}  \n"
        (root / f"data.{pos_file}").write_text(out, encoding="utf-8")
    return root


def synthetic_rows(n_per_class: int = 60, seed: int = 0) -> list[tuple[str, str, int, list[str], str]]:
    rng = random.Random(seed)
    filler = ["the", "of", "a", "that", "which", "or", "in", "to", "is", "for"]
    rows = []
    for (pos_file, ss_type, lex), words in CLASS_WORDS.items():
        for i in range(n_per_class):
            n = rng.randint(3, 14)
            gloss = " ".join(rng.choice(words if rng.random() < 0.5 else filler) for _ in range(n))
            rows.append((pos_file, ss_type, lex, [f"{words[i % len(words)]}_{i}"], gloss))
    rows.append(("adv", "r", 2, ["quickly"], "with speed"))
    return rows


@pytest.fixture(autouse=True)
def _no_wandb_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs in tests log JSONL only (W&B init costs seconds); W&B tests delete this variable."""
    monkeypatch.setenv("WANDB_MODE", "disabled")


@pytest.fixture(autouse=True)
def _cpu_without_native_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test sees a CPU without native bf16 unless it asks for :func:`precision_branch`: ``precision=auto``
    then picks fp32 by rule on every machine (AVX2-only or AVX512-BF16), never a measured, machine-dependent
    choice. (Subprocesses do not inherit this; their tests compare runs on the same machine.)"""
    monkeypatch.setattr("train.precision.cpu_native_bf16", lambda: False)


@pytest.fixture(params=["cpu-without-native-bf16", "cpu-with-native-bf16"])
def precision_branch(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> dict:
    """Both branches of ``precision=auto`` on a CPU, on any machine: the decision's inputs (native bf16 or not,
    the probe's fp32/bf16 timing: bf16 3x faster, and a quiet machine) are forced. Returns what ``auto`` must then
    decide."""
    native = request.param == "cpu-with-native-bf16"
    calls: list = []

    def measured(probe, repeats=9):
        calls.append(probe)
        return {"fp32_ms": 3.0, "bf16_ms": 1.0, "ratio": 3.0, "repeats": repeats}

    monkeypatch.setattr("train.precision.cpu_native_bf16", lambda: native)
    monkeypatch.setattr("train.precision.measure_bf16_speedup", measured)
    monkeypatch.setattr("train.precision.machine_load", lambda: 0.0)  # a quiet machine: the decision is cached
    return {"native": native, "mode": "bf16" if native else "fp32", "source": "measured" if native else "rule",
            "probe_calls": calls}


@pytest.fixture
def wndb(tmp_path: Path) -> Path:
    return write_wndb(tmp_path / "wn", synthetic_rows())


@pytest.fixture
def tiny_cfg(wndb: Path, tmp_path: Path):
    """A config that trains the smallest model for a few steps on the fixture WordNet."""

    def make(*overrides: str):
        base = [f"data.wordnet_dir={wndb}", f"data.cache_dir={tmp_path / 'cache'}", "data.vocab_size=200",
                "data.max_len=32", "model.num_layers=1", "model.hidden_size=32", "model.num_heads=2",
                "model.ffn_size=64", "model.dropout=0.0", "batching.num_buckets=3", "batching.batch_size=16",
                "train.max_steps=30", "train.eval_every=15", "train.log_every=5", "train.progress=false",
                f"train.output_dir={tmp_path / 'runs'}", "train.run_id=t", "optim.lr=5e-3"]
        return load_config(None, base + list(overrides))

    return make


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records), encoding="utf-8")
    return path


# -- a tiny trainer, a batch, host reads (test_numerics, test_step_timer, test_precision) ----------------------

CPU = torch.device("cpu")
HOST_READS = {"item", "__bool__", "__float__", "__int__", "__index__", "tolist", "numpy", "cpu"}


class HostReads(TorchFunctionMode):
    """Counts reads of tensor values by the host (each one a host-device sync on CUDA)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            self.names.append(name)
        return func(*args, **(kwargs or {}))


def small_trainer(*overrides: str, policy: PrecisionPolicy | None = None) -> Trainer:
    from train.models.encoder import EncoderClassifier, resolve_spec
    from train.precision import PrecisionPolicy
    from train.trainer import Trainer

    cfg = load_config(None, ["train.max_steps=100", "model.dropout=0.0", *overrides])
    torch.manual_seed(0)
    model = EncoderClassifier(resolve_spec("tiny", 50, 5, 16, 0.0, num_layers=1, hidden_size=16, num_heads=2,
                                           ffn_size=32))
    policy = policy or PrecisionPolicy(mode="fp32", reason="test", device=CPU)
    return Trainer(cfg=cfg, model=model, policy=policy, device=CPU, train_loader=[None], num_classes=5)


def batch(seed: int = 0) -> dict:
    """A collated batch as the loaders give it: 4 samples × 16 tokens, no padding."""
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, 50, (4, 16), generator=g),
            "attention_mask": torch.ones(4, 16, dtype=torch.bool),
            "labels": torch.randint(0, 5, (4,), generator=g), "real_tokens": 64, "truncated": 0}


# -- the CLI in a subprocess (test_cli, test_bench_batching) -----------------------------------------------------

def run_cli(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    root = Path(__file__).resolve().parent.parent
    full_env = {**os.environ, "PYTHONPATH": str(root), **(env or {})}
    return subprocess.run([sys.executable, "-m", "train", *args], capture_output=True, text=True, env=full_env,
                          cwd=cwd or root, timeout=120)


def assert_clean_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: ")
    for fragment in fragments:
        assert fragment in proc.stderr, proc.stderr


# -- resume comparison (test_resume, test_models) -----------------------------------------------------------------

TIMING = ("step_time_ms", "samples_per_s")


def metrics(run_dir: Path) -> list[dict]:
    """metrics.jsonl without the wall-clock fields."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records if r.get("event") != "system"]


def resume_from_first_checkpoint(cfg, run_dir: Path) -> tuple[dict, Path]:
    """Train ``cfg`` (which writes periodic checkpoints into ``run_dir``), remove its final checkpoint and report,
    and resume it from its first periodic checkpoint: (the resumed run's report, that checkpoint)."""
    from train.resume import list_checkpoints
    from train.run.training import run_training

    run_training(cfg, time.perf_counter())
    first = list_checkpoints(run_dir)[0]
    (run_dir / "checkpoint.pt").unlink()
    (run_dir / "report.json").unlink()
    return run_training(cfg, time.perf_counter(), resume=str(first)), first


def assert_same_final_state(a: Path, b: Path) -> None:
    """Bit-identical parameters and optimizer state, equal losses and metrics."""
    from train.compat import load_state

    ca, cb = load_state(str(a / "checkpoint.pt")), load_state(str(b / "checkpoint.pt"))
    assert ca["step"] == cb["step"]
    assert all(torch.equal(ca["model"][k], cb["model"][k]) for k in ca["model"])
    for sa, sb in zip(ca["optimizer"]["state"].values(), cb["optimizer"]["state"].values()):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    ra, rb = json.loads((a / "report.json").read_text()), json.loads((b / "report.json").read_text())
    assert ra["quality"]["final_train_loss"] == rb["quality"]["final_train_loss"]
    assert ra["quality"]["evals"] == rb["quality"]["evals"]
    assert ra["quality"]["test_accuracy"] == rb["quality"]["test_accuracy"]
    assert ra["perf"]["train_samples_seen"] == rb["perf"]["train_samples_seen"]
    assert metrics(a) == metrics(b)


# -- a metric logger that keeps records (test_tracking, test_nvml) ------------------------------------------------

class ListLogger:
    def __init__(self) -> None:
        self.records: list[dict] = []

    def log(self, record: dict) -> None:
        self.records.append(record)

    def close(self) -> None:
        pass


# -- multi-process runs: tiny-run overrides, a free port, interruption, a spawned DDP worker ------------------

def tiny_overrides(wndb: Path, root: Path, *extra: str) -> list[str]:
    """The conftest ``tiny_cfg`` settings as ``section.key=value`` strings (for subprocesses), dropout on (torch's
    ``nn.Dropout``: ``model.fast_dropout=false``, so two fresh runs never differ by a measured decision)."""
    return [f"data.wordnet_dir={wndb}", f"data.cache_dir={root / 'cache'}", "data.vocab_size=200", "data.max_len=32",
            "model.num_layers=1", "model.hidden_size=32", "model.num_heads=2", "model.ffn_size=64", "model.dropout=0.1",
            "model.fast_dropout=false",
            "batching.num_buckets=3", "batching.batch_size=8", "train.max_steps=30", "train.eval_every=10",
            "train.log_every=3", "train.progress=false", f"train.output_dir={root / 'runs'}", "optim.lr=5e-3",
            "train.num_threads=1", *extra]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def interrupt_at(monkeypatch_target, step: int, signum: int = signal.SIGTERM) -> None:
    """Make this process signal itself during training step ``step`` (deterministic interruption)."""
    from train.trainer import Trainer

    original = Trainer.step
    calls = {"n": 0}

    def counted_step(self, *args, **kwargs):
        if kwargs.get("count", True):  # training steps, not warm-up or probe steps
            calls["n"] += 1
            if self.start_step + calls["n"] == step:
                os.kill(os.getpid(), signum)
        return original(self, *args, **kwargs)

    monkeypatch_target.setattr(Trainer, "step", counted_step)


class _Patch:
    def setattr(self, obj, name, value) -> None:
        setattr(obj, name, value)


def ddp_worker(rank: int, world: int, port: int, overrides: list[str], out_dir: str, resume: str | None,
               signal_rank: int | None, signal_step: int | None) -> None:
    """One rank of a Gloo DDP run (for ``torch.multiprocessing.spawn``).

    Records which training-split indices this rank's DataLoader fetched, runs ``run_training`` and
    writes ``<out_dir>/rank<r>.json`` with the indices, the report and a checksum of its parameters.
    """
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
                       "RANK": str(rank), "LOCAL_RANK": str(rank)})
    from train.config import load_config
    from train.data.collate import TokenDataset
    from train.run.training import run_training

    seen: list[tuple[int, int]] = []
    original = TokenDataset.__getitem__

    def getitem(self, i):
        seen.append((len(self.split), int(i)))
        return original(self, i)

    TokenDataset.__getitem__ = getitem
    from train.data.packing import RowDataset  # packed training rows index (row, sample index)

    original_row = RowDataset.__getitem__

    def getrow(self, key):
        seen.append((len(self.split), int(key[1])))
        return original_row(self, key)

    RowDataset.__getitem__ = getrow
    if signal_rank == rank and signal_step is not None:
        interrupt_at(_Patch(), signal_step)
    captured = {}
    from train import trainer as trainer_mod

    original_fit = trainer_mod.Trainer.fit

    def fit(self):
        stats = original_fit(self)
        flat = torch.cat([p.detach().reshape(-1) for p in self.model.parameters()])
        captured["param_sum"] = float(flat.double().sum())
        captured["param_sha256"] = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
        return stats

    trainer_mod.Trainer.fit = fit
    t0 = time.perf_counter()
    report = run_training(load_config(None, overrides), t0, resume=resume)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"seen": seen, "report": report, **captured}))


# --- tiny causal LMs (tests/test_causal_models.py, tests/test_chunked_loss.py) ---
CAUSAL_VOCAB = 100
CAUSAL_KINDS = ("llama", "qwen2", "gpt2")
CAUSAL_TINY = {"llama": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=128, max_position_embeddings=64, attention_dropout=0.0),
               "qwen2": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=128, max_position_embeddings=64, attention_dropout=0.0),
               "gpt2": dict(n_layer=2, n_embd=64, n_head=4, n_inner=128, n_positions=64, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2)}
CAUSAL_ATTENTION = sorted({hf_attn_implementation(), "eager"})  # torch 2.1: eager only (transformers refuses SDPA)
CAUSAL_LENGTHS = (7, 3, 12, 5)
CAUSAL_ROWS = ((2, 1), (0, 3))  # sample indices per packed row: 12 + 3 (+1 padding), 7 + 5 (+4 padding)
CAUSAL_CAPACITY = 16


def tiny_causal_lm(kind: str, attn: str, **extra):
    """A tiny random-init Hugging Face decoder of family ``kind`` (fp32, eval mode) in the causal-LM wrapper."""
    import transformers

    from train.models.causal import ExternalCausalLM
    from train.models.wrap import ExternalSpec

    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(kind, vocab_size=CAUSAL_VOCAB, pad_token_id=0,
                                               **{**CAUSAL_TINY[kind], **extra})
    inner = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn).float().eval()
    return ExternalCausalLM(inner, ExternalSpec(f"hf:{kind}", 0, CAUSAL_VOCAB, 64, task="causal-lm"), "hf")


def causal_samples() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(1, CAUSAL_VOCAB, (n,), generator=gen) for n in CAUSAL_LENGTHS]


def packed_causal_batch(samples: list[torch.Tensor], rows=CAUSAL_ROWS, capacity: int = CAUSAL_CAPACITY) -> dict:
    """The contract's packed batch: positions restart per sample, seq_index the sample's slot (-1 padding), labels
    the next token within the sample (-100 at each sample's last position and on padding)."""
    shape = (len(rows), capacity)
    ids, pos, labels = torch.zeros(shape, dtype=torch.long), torch.zeros(shape, dtype=torch.long), \
        torch.full(shape, -100, dtype=torch.long)
    seq = torch.full(shape, -1, dtype=torch.long)
    slot = 0
    for r, row in enumerate(rows):
        at = 0
        for i in row:
            s = samples[i]
            ids[r, at:at + len(s)], pos[r, at:at + len(s)], seq[r, at:at + len(s)] = s, torch.arange(len(s)), slot
            labels[r, at:at + len(s) - 1] = s[1:]
            at, slot = at + len(s), slot + 1
    return {"input_ids": ids, "attention_mask": seq >= 0, "position_ids": pos, "seq_index": seq, "labels": labels,
            "num_seqs": slot}


# --- causal-LM data (tests/test_causal_data.py, tests/test_data_policies.py) ---

WORDS = ["q", "what", "is", "two", "plus", "four", "the", "answer", "a", "b", "c", "d", "e"]


def word_tokenizer(specials=("<s>", "</s>"), bos_template: bool = False) -> "Tokenizer":
    """A whitespace word-level tokenizer: the specials first (ids 0, 1, …), then ``[UNK]``, then :data:`WORDS`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {w: i for i, w in enumerate([*specials, "[UNK]", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(specials))
    if bos_template:  # Llama's template: BOS before every text
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    return tok


def causal_cfg(tmp_path: Path, *overrides: str):
    """A causal-LM config for the data tests: max_len 16, the caches under ``tmp_path``."""
    return load_config(None, ["model.task=causal-lm", f"data.cache_dir={tmp_path / 'cache'}", "data.max_len=16",
                              "data.vocab_size=300", "train.progress=false", "batching.num_buckets=2", *overrides])


# --- a whole tiny causal-LM run (tests/test_causal_run.py, tests/test_fsdp.py) ---

LLAMA = ("model.hf_overrides={num_hidden_layers: 1, hidden_size: 32, num_attention_heads: 4, "
         "intermediate_size: 64}")


def causal_overrides(wndb: Path, root: Path, *extra: str) -> list[str]:
    """The classification tests' tiny settings turned into a tiny Llama learning the glosses in packed rows. The
    attention path and the chunked loss are pinned: ``auto`` measures, and two runs on a busy machine may pick
    differently (a resume must then equal a run that chose as it did)."""
    return tiny_overrides(wndb, root, "model.task=causal-lm", "model.source=hf:llama", LLAMA, "data.vocab_size=300",
                          "batching.method=packed", "batching.max_tokens=128", "model.dropout=0.0",
                          "model.packed_attention=sdpa-mask", "model.chunked_loss=false", *extra)


# --- a tiny Llama stepped whole or sharded over 2 ranks (tests/test_fsdp.py, tests/test_checkpoint_blocks.py) ---

needs_fsdp2 = pytest.mark.skipif(fsdp2_api()[0] is None, reason=fsdp2_api()[1])
VOCAB, STEPS, ROW = 101, 3, 16  # 101 and intermediate_size 75: dimension 0 does not split evenly over 2 ranks
LENGTHS = (7, 3, 12, 5)


def tiny_llama() -> torch.nn.Module:
    """A random-init Llama with uneven dimension-0 sizes (vocabulary 101, MLP 75), fp32, packing probed."""
    import transformers

    from train.compat import hf_attn_implementation
    from train.models.causal import ExternalCausalLM
    from train.models.causal_probe import probe_causal_packing
    from train.models.wrap import ExternalSpec

    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model("llama", vocab_size=VOCAB, pad_token_id=0, num_hidden_layers=2,
                                               hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                               intermediate_size=75, max_position_embeddings=64, attention_dropout=0.0)
    inner = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=hf_attn_implementation())
    model = ExternalCausalLM(inner.float(), ExternalSpec("hf:llama", 0, VOCAB, 64, task="causal-lm"), "hf").train()
    assert probe_causal_packing(model)[0]
    return model


def half_batch(half: int, step: int, packed: bool) -> dict:
    """Rank ``half``'s half of step ``step``'s global batch: 2 rows of 16 tokens with the same number of target tokens
    on either half (so the mean of the halves' per-token losses is the global batch's)."""
    gen = torch.Generator().manual_seed(100 * step + half)
    if packed:
        samples = [torch.randint(1, VOCAB, (n,), generator=gen) for n in LENGTHS]
        batch = packed_causal_batch(samples)
        batch["samples"] = len(samples)
    else:
        ids = torch.randint(1, VOCAB, (2, ROW), generator=gen)
        labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
        batch = {"input_ids": ids, "attention_mask": torch.ones(2, ROW, dtype=torch.bool), "labels": labels}
    batch["real_tokens"] = int(batch["attention_mask"].sum())
    batch["target_tokens"] = int((batch["labels"] != -100).sum())
    return batch


def global_batch(step: int, packed: bool) -> dict:
    """Both halves of step ``step``'s batch as one (rank 0's rows first; packed slots renumbered)."""
    a, b = half_batch(0, step, packed), half_batch(1, step, packed)
    out = {k: torch.cat([a[k], b[k]]) for k in ("input_ids", "attention_mask", "labels")}
    if packed:
        out["position_ids"] = torch.cat([a["position_ids"], b["position_ids"]])
        out["seq_index"] = torch.cat([a["seq_index"], torch.where(b["seq_index"] >= 0, b["seq_index"] + a["num_seqs"],
                                                                  b["seq_index"])])
        out["num_seqs"], out["samples"] = a["num_seqs"] + b["num_seqs"], a["samples"] + b["samples"]
    for k in ("real_tokens", "target_tokens"):
        out[k] = a[k] + b[k]
    return out


def trainer_for(model: torch.nn.Module, chunked: bool, ctx=None):
    from train.config import load_config
    from train.precision import PrecisionPolicy
    from train.trainer import Trainer

    model.set_chunked_loss(chunked)
    # max_norm below the gradients' norm: the clip scales every step, so a per-rank norm would show. lr 1e-3: AdamW
    # divides by sqrt(v), so at 10x that the last-bit differences of near-zero gradients (summed in another order
    # over shards) move a few weights past 1e-5, while the gradients themselves agree to float rounding
    cfg = load_config(None, ["model.task=causal-lm", "train.max_steps=100", "optim.warmup_fraction=0.0",
                             "optim.lr=0.001", "clip.max_norm=0.5", "dist.strategy=fsdp"])
    cpu = torch.device("cpu")
    return Trainer(cfg=cfg, model=model, policy=PrecisionPolicy(mode="fp32", reason="test", device=cpu), device=cpu,
                   train_loader=[None], num_classes=VOCAB, dist_ctx=ctx)


def run_steps(trainer, batches) -> tuple[list[float], list[float], dict]:
    """Losses and pre-clip norms of a step per batch, and the (clipped) gradients of the first step."""
    from train.compat import full_tensor

    losses, norms, grads = [], [], {}
    for i, batch in enumerate(batches):
        rec = trainer.step(batch)
        losses.append(rec.loss.detach())
        norms.append(float(rec.grad_norm))
        if i == 0:
            grads = {n: full_tensor(p.grad).clone() for n, p in trainer.model.named_parameters()}
    return losses, norms, grads


def sharded_rank(rank: int, world: int, port: int, path: str = "sdpa-mask", chunked: bool = False,
                 offload: bool = False) -> tuple:
    """One of ``world`` spawned Gloo ranks (``OMP``-like: one thread): its process group, the tiny Llama (packed
    attention ``path``) sharded by the product's wrap, and a Trainer on it: ``(ctx, device, model, trainer)``.
    The caller tears the group down (``train.parallel.process_group.teardown``)."""
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
                       "RANK": str(rank), "LOCAL_RANK": str(rank)})
    torch.set_num_threads(1)
    from train.parallel.process_group import init_distributed, wrap_model

    ctx, device = init_distributed(torch.device("cpu"))
    model = tiny_llama()
    model.set_packed_attention(path)
    wrap_model(model, ctx, device, "fsdp", "fp32", offload)
    return ctx, device, model, trainer_for(model, chunked, ctx)


def run_worker(rank: int, world: int, port: int, overrides: list[str], resume: str | None) -> None:
    """One rank of a whole ``python -m train train`` run (for ``torch.multiprocessing.spawn``)."""
    import time

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
                       "RANK": str(rank), "LOCAL_RANK": str(rank)})
    from train.config import load_config
    from train.run.training import run_training

    run_training(load_config(None, overrides), time.perf_counter(), resume=resume)


def spawn_run(overrides: list[str], resume: Path | None = None) -> None:
    mp.spawn(run_worker, args=(2, free_port(), overrides, str(resume) if resume else None), nprocs=2, join=True)
