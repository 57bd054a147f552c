"""Built-in real data: WordNet supersense (lexicographer file) classification.

Reads a WordNet database directory in the WNDB format (Princeton WordNet 3.0, wndb(5WN)):
``data.noun``, ``data.verb``, ``data.adj``, ``data.adv``. Each synset becomes one example:

* text  = its lemma names (underscores → spaces, adjective markers such as ``(p)`` removed),
  joined with ", ", then ": " and its gloss;
* label = its lexicographer file number ``lex_filenum`` (0–44), named by the standard
  lexnames list (``noun.animal``, ``verb.motion``, …; lexnames(5WN)).

WordNet 3.0 gives 117,659 synsets in 45 classes.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from train.errors import UserError

POS_FILES = ("noun", "verb", "adj", "adv")

# lexnames(5WN): lexicographer file number → name. Fixed by the WordNet 3.0 distribution.
LEXNAMES = (
    "adj.all", "adj.pert", "adv.all", "noun.Tops", "noun.act", "noun.animal", "noun.artifact",
    "noun.attribute", "noun.body", "noun.cognition", "noun.communication", "noun.event",
    "noun.feeling", "noun.food", "noun.group", "noun.location", "noun.motive", "noun.object",
    "noun.person", "noun.phenomenon", "noun.plant", "noun.possession", "noun.process",
    "noun.quantity", "noun.relation", "noun.shape", "noun.state", "noun.substance", "noun.time",
    "verb.body", "verb.change", "verb.cognition", "verb.communication", "verb.competition",
    "verb.consumption", "verb.contact", "verb.creation", "verb.emotion", "verb.motion",
    "verb.perception", "verb.possession", "verb.social", "verb.stative", "verb.weather",
    "adj.ppl",
)

_ADJ_MARKER = re.compile(r"\((?:a|p|ip)\)$")

INSTALL_HINT = (
    "install it with `apt-get install wordnet-base` (Debian/Ubuntu; `make data` does this as root), "
    "or point WNHOME (or data.wordnet_dir) at a WordNet 3.0 dict directory"
)


@dataclass(frozen=True)
class Synset:
    """One parsed data-file line. ``offset`` is the byte offset field, ``pos`` one of n/v/a/s/r."""

    pos: str
    offset: int
    lex_filenum: int
    lemmas: tuple[str, ...]
    gloss: str

    @property
    def text(self) -> str:
        return f"{', '.join(self.lemmas)}: {self.gloss}"


def candidate_dirs() -> list[Path]:
    """Directories searched for a WNDB database, in order."""
    out: list[Path] = []
    wnhome = os.environ.get("WNHOME")
    if wnhome:
        out += [Path(wnhome), Path(wnhome) / "dict"]
    out.append(Path("/usr/share/wordnet"))
    nltk_roots = [os.environ.get("NLTK_DATA"), str(Path.home() / "nltk_data"), "/usr/share/nltk_data",
                  "/usr/local/share/nltk_data", "/usr/lib/nltk_data"]
    out += [Path(r) / "corpora" / "wordnet" for r in nltk_roots if r]
    return out


def find_wordnet_dir(explicit: Optional[str] = None) -> Path:
    """Return the first directory holding all four ``data.*`` files.

    Raises:
        UserError: none found; the message lists where it looked and how to install WordNet.
    """
    dirs = [Path(explicit)] if explicit else candidate_dirs()
    for d in dirs:
        if all((d / f"data.{pos}").is_file() for pos in POS_FILES):
            return d
    looked = ", ".join(str(d) for d in dirs)
    raise UserError(f"WordNet database not found (looked in: {looked}); {INSTALL_HINT}")


def parse_data_line(line: str, path: str, lineno: int) -> Synset:
    """Parse one WNDB data line (wndb(5WN)): ``offset lex_filenum ss_type w_cnt (word lex_id)… p_cnt … | gloss``.

    Raises:
        UserError: the line does not follow the format (names file and line).
    """
    try:
        head, _, gloss = line.partition(" | ")
        fields = head.split()
        offset = int(fields[0])
        lex_filenum = int(fields[1])
        pos = fields[2]
        w_cnt = int(fields[3], 16)  # word count is two hexadecimal digits
        words = fields[4 : 4 + 2 * w_cnt : 2]
        if len(words) != w_cnt or pos not in "nvasr" or not 0 <= lex_filenum < len(LEXNAMES):
            raise ValueError
    except (ValueError, IndexError):
        raise UserError(f"{path}:{lineno}: not a WordNet data line (wndb format); "
                        "is this a WordNet 3.0 dict directory?") from None
    lemmas = tuple(_ADJ_MARKER.sub("", w).replace("_", " ") for w in words)
    return Synset(pos=pos, offset=offset, lex_filenum=lex_filenum, lemmas=lemmas, gloss=gloss.strip())


def iter_synsets(root: Path) -> Iterator[Synset]:
    """Yield every synset of the four data files, skipping the license header (lines starting with spaces)."""
    for pos in POS_FILES:
        path = root / f"data.{pos}"
        with open(path, encoding="utf-8", errors="strict") as f:
            for lineno, line in enumerate(f, 1):
                if line.startswith("  ") or not line.strip():
                    continue
                yield parse_data_line(line.rstrip("\n"), str(path), lineno)
