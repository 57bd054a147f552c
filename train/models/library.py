"""The transformers library as every model path uses it: imported offline (never a download at run time) and quiet
(no progress bars), or one line when it is not installed. Below every module that builds, converts or serves a
Hugging Face model, so that they never import each other for it."""

from __future__ import annotations

import os

from train.errors import UserError


def import_transformers():
    """The ``transformers`` module, offline (never a download), quiet (no progress bars); UserError when it is not
    installed."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never a download at run time
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import transformers
    except ImportError:
        raise UserError("model.source=hf:…: the transformers package is not installed (pip install -r "
                        "requirements.txt)") from None
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()  # no "Loading weights" bars on stderr
    return transformers


TEMPLATE_FILES = ("chat_template.jinja", "tokenizer_config.json")
"""Where a Hugging Face model directory keeps its chat template (transformers 5 writes the first; older saves the key
``chat_template`` of the second)."""
