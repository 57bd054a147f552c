"""Write a large text-classification JSONL of random words, for measuring data preparation at the size users have.

    python scripts/make_big_jsonl.py OUT.jsonl [--rows 2000000] [--labels 20] [--seed 0]

Each line is ``{"text": "<random words>", "label": "label_07"}``: 8-23 words drawn (Zipf-like) from a vocabulary of
30,000 made-up words of 2-4 syllables, one of ``--labels`` string labels. 2,000,000 rows are ~315 MB. The same
arguments write the same bytes.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

SYLLABLES = [c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou")]


def vocabulary(rng: np.random.Generator, size: int) -> list[str]:
    words: set[str] = set()
    while len(words) < size:
        n = int(rng.integers(2, 5))
        words.add("".join(SYLLABLES[k] for k in rng.integers(0, len(SYLLABLES), n)))
    out = sorted(words)
    rng.shuffle(out)  # frequency independent of spelling
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--labels", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    words = np.asarray(vocabulary(rng, 30_000), dtype=object)
    weights = 1.0 / np.arange(1, len(words) + 1) ** 0.8
    weights /= weights.sum()
    labels = [f"label_{k:02d}" for k in range(args.labels)]
    block = 50_000
    with open(args.out, "w", encoding="utf-8") as f:
        for start in range(0, args.rows, block):
            n = min(block, args.rows - start)
            counts = rng.integers(8, 24, n)
            picks = words[rng.choice(len(words), size=int(counts.sum()), p=weights)]
            label_ids = rng.integers(0, len(labels), n)
            ends = np.cumsum(counts)
            f.write("".join(json.dumps({"text": " ".join(picks[e - c:e]), "label": labels[k]}) + "\n"
                            for e, c, k in zip(ends.tolist(), counts.tolist(), label_ids.tolist())))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
