"""Exact duplicate removal: the first document with a given normalised text is kept.

Normalisation before hashing: lower case and every run of whitespace made one space (so copies
that differ only in case, line breaks or indentation count as the same text). Key: the first
16 bytes of SHA-1 of the UTF-8 bytes (collision odds are negligible at corpus sizes here).
"""
from __future__ import annotations

import hashlib


def exact_key(text: str) -> bytes:
    return hashlib.sha1(" ".join(text.lower().split()).encode("utf-8")).digest()[:16]


class ExactDeduper:
    """Feed documents in corpus order; `check` returns the id of the earlier copy, or None."""

    def __init__(self) -> None:
        self.first: dict[bytes, str] = {}

    def check(self, doc_id: str, key: bytes) -> str | None:
        prev = self.first.get(key)
        if prev is None:
            self.first[key] = doc_id
        return prev
