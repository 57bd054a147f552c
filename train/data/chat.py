"""Chat rows for ``model.task=causal-lm``, as TRL's ``SFTTrainer`` takes them: ``{"messages": [{"role": ...,
"content": ...}, ...]}``, rendered with the model's own chat template (transformers' ``apply_chat_template``) and
trained on the final assistant turn only (TRL's ``assistant_only_loss`` for single-turn rows).

A conversation becomes the project's prompt + completion row (train/data/causal_rows.py), so it is packed, masked
and cut exactly as those are: the prompt is the template's rendering of every message before the last assistant
turn with the generation prompt (``<|im_start|>assistant\\n``); the completion is the rest of the full rendering,
the assistant's content, whose end-of-turn token the sample's EOS becomes (the template's own end-of-turn is cut
from the completion so that it is not there twice). Earlier assistant turns of a multi-turn row are context, not
targets. A row without an assistant turn, or with a role the template does not take, is dropped and counted by the
data policy (``no_assistant_turn``, ``unknown_role``).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

from train.errors import UserError
from train.models.library import TEMPLATE_FILES, import_transformers

ROLES = ("system", "user", "assistant")
"""The roles a chat row may use (the chat templates of instruction-tuned models know these; ``tool`` is not
supported)."""


class ChatTemplate:
    """A model's chat template: :meth:`split` turns a conversation into ``(prompt, completion)`` strings.

    Built from the directory of a ``tokenizer.json`` (the model directory), through transformers' tokenizer, whose
    ``apply_chat_template`` renders it (Jinja, sandboxed)."""

    def __init__(self, tokenizer_dir: Path) -> None:
        self.dir = tokenizer_dir
        self.tok = import_transformers().AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
        if not getattr(self.tok, "chat_template", None):
            raise UserError(no_template(str(tokenizer_dir)))
        self.eos = self.tok.eos_token

    def render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def split(self, messages: Any, loc: str) -> tuple[str, str, Optional[str]]:
        """``(prompt, completion, drop cause)`` of one conversation (see the module docstring).

        Raises:
            UserError: ``messages`` is not a list of ``{"role": str, "content": str}`` objects (naming ``loc``).
        """
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise UserError(f"{loc}: messages must be a list of {{\"role\": ..., \"content\": ...}} objects, got "
                            f"{type(messages).__name__}")
        for m in messages:
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise UserError(f"{loc}: each message needs a string role and a string content, got "
                                f"{ {k: type(v).__name__ for k, v in m.items()} }")
        if any(m["role"] not in ROLES for m in messages):
            return "", "", "unknown_role"
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
        if last is None:
            return "", "", "no_assistant_turn"
        turns = [{"role": m["role"], "content": m["content"]} for m in messages[:last + 1]]
        prompt = self.render(turns[:-1], generation_prompt=True)
        full = self.render(turns, generation_prompt=False)
        if not full.startswith(prompt):
            raise UserError(f"{loc}: the chat template of {self.dir} does not render the conversation as its prompt "
                            "followed by the answer, so the answer's tokens cannot be found; give prompt/completion "
                            "rows instead")
        completion = full[len(prompt):]
        body = completion.rstrip()
        if self.eos and body.endswith(self.eos):  # the sample's EOS is the template's end-of-turn
            completion = body[:-len(self.eos)]
        return prompt, completion, None if completion.strip() else "empty_completion"


def no_template(where: str) -> str:
    return (f"chat rows (messages) need the model's chat template, and {where} has none ({' / '.join(TEMPLATE_FILES)}"
            "'s chat_template); use an instruction-tuned model with one (make models: smollm2-135m-instruct), or "
            "give prompt/completion rows")


@lru_cache(maxsize=4)
def chat_template_for(tokenizer_path: Optional[str]) -> ChatTemplate:
    """The chat template beside ``data.tokenizer_path`` (the model directory's ``tokenizer.json``), loaded once.

    Raises:
        UserError: no tokenizer path (the project's own BPE has no template) or the directory has no template.
    """
    if not tokenizer_path:
        raise UserError(no_template("the tokenizer trained on the data (no data.tokenizer_path or "
                                    "model.source=hf:<dir>)"))
    return ChatTemplate(Path(tokenizer_path).expanduser().parent)


def template_bytes(tokenizer_dir: Optional[Path]) -> bytes:
    """The files that hold a directory's chat template, for the prepared-data cache key (b"" without them)."""
    if tokenizer_dir is None:
        return b""
    return b"".join(name.encode() + b"\0" + (tokenizer_dir / name).read_bytes() + b"\0"
                    for name in TEMPLATE_FILES if (tokenizer_dir / name).is_file())
