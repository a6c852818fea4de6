"""Text helpers for the quality models: CCNet-style normalisation and corpus reading.

`ccnet_normalize` follows CCNet's text_normalizer: lower case, accents stripped, every digit
→ "0", Unicode punctuation mapped to ASCII, non-printing characters removed, spaces collapsed
(line breaks kept: perplexity is computed per line/paragraph). `lm_tokens` splits a normalised
line into words and single punctuation marks (CCNet uses a SentencePiece model here; plain
tokens need no extra model).

`iter_corpus(globs, data_root)` reads .txt (cut into passages of `passage_words` words),
.jsonl/.jsonl.gz ("text" field) and Parquet ("text" column) files.
"""
from __future__ import annotations

import glob
import gzip
import json
import random
import unicodedata
from pathlib import Path
from typing import Iterator

import regex

_PUNCT = str.maketrans({
    "，": ",", "。": ".", "、": ",", "„": '"', "”": '"', "“": '"', "«": '"', "»": '"', "１": '"',
    "」": '"', "「": '"', "《": '"', "》": '"', "´": "'", "∶": ":", "：": ":", "？": "?", "！": "!",
    "（": "(", "）": ")", "；": ";", "–": "-", "—": " - ", "．": ". ", "～": "~", "’": "'", "…": "...",
    "━": "-", "〈": "<", "〉": ">", "【": "[", "】": "]", "％": "%", "►": "-", "‘": "'",
})
_NON_PRINTING = regex.compile(r"[\p{Cc}\p{Cf}\p{Co}\p{Cn}&&[^\n\t]]", flags=regex.V1)
_MARKS = regex.compile(r"\p{Mn}+")
_DIGIT = regex.compile(r"\d")
_SPACES = regex.compile(r"[ \t]+")
_TOKEN = regex.compile(r"\w+|[^\w\s]")


def ccnet_normalize(text: str) -> str:
    text = text.lower().translate(_PUNCT)
    if not text.isascii():
        text = _MARKS.sub("", unicodedata.normalize("NFD", text))
    text = _NON_PRINTING.sub("", text)
    text = _DIGIT.sub("0", text)
    lines = (_SPACES.sub(" ", ln).strip() for ln in text.split("\n"))
    return "\n".join(ln for ln in lines if ln)


def lm_tokens(line: str) -> list[str]:
    return _TOKEN.findall(line)


def resolve(patterns: list[str], data_root: str | Path) -> list[Path]:
    paths: list[Path] = []
    for pat in patterns:
        full = pat if Path(pat).is_absolute() else str(Path(data_root) / pat)
        paths.extend(Path(p) for p in sorted(glob.glob(full)))
    return paths


def _read_file(path: Path, passage_words: int) -> Iterator[str]:
    name = path.name
    if name.endswith(".parquet"):
        from tasks.core.documents import iter_docs

        for d in iter_docs([path], columns=["text"]):
            yield d["text"]
    elif name.endswith((".jsonl", ".jsonl.gz", ".json.gz")):
        opener = gzip.open if name.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)["text"]
    else:
        cur: list[str] = []
        n = 0
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            if not line.strip():
                continue
            cur.append(line.strip())
            n += len(line.split())
            if n >= passage_words:
                yield "\n".join(cur)
                cur, n = [], 0
        if cur:
            yield "\n".join(cur)


def iter_corpus(patterns: list[str], data_root: str | Path, passage_words: int = 200) -> Iterator[tuple[str, str]]:
    """(source file name, text) of every document of the files matching `patterns`."""
    paths = resolve(patterns, data_root)
    if not paths:
        raise FileNotFoundError(f"no files match {patterns} under {data_root}")
    for path in paths:
        for text in _read_file(path, passage_words):
            if text.strip():
                yield path.name, text


def sample_corpus(patterns: list[str], data_root: str | Path, max_docs: int, seed: int = 0,
                  passage_words: int = 200) -> list[str]:
    """Up to `max_docs` documents drawn evenly at random from the corpus (seeded)."""
    docs = [t for _, t in iter_corpus(patterns, data_root, passage_words)]
    rng = random.Random(seed)
    rng.shuffle(docs)
    return docs[:max_docs]
