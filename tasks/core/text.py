"""Text utilities shared by the curation filters (`tasks.curate`) and deduplication (`tasks.dedup`):
here, below both, so neither imports the other for them."""
from __future__ import annotations


class CharTable(dict):
    """A `str.translate` table filled per code point on first sight by `rule(ch)` (the
    replacement string, or None to delete the character): one C pass over a text in place of
    regex substitutions, with the same result wherever `rule` gives a character what the regex
    would. Grows with the distinct characters seen (at most the Unicode range)."""

    def __init__(self, rule):
        super().__init__()
        self.rule = rule

    def __missing__(self, code: int):
        out = self[code] = self.rule(chr(code))
        return out
