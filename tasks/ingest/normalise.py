"""Text normalisation applied to every ingested document.

* Unicode NFC (`ingest.normalise_nfc`): composed characters, so the same word has one
  byte form whatever the page used.
* Whitespace (`ingest.normalise_whitespace`): CR/CRLF and Unicode line/paragraph separators
  become "\\n"; every other run of whitespace inside a line (tabs, NBSP, ideographic space...)
  becomes one space; lines are stripped; runs of blank lines become one blank line (paragraph
  breaks are kept: the Gopher repetition filter splits paragraphs on blank lines); control
  characters and BOMs are removed; the text is stripped.
"""
from __future__ import annotations

import re
import unicodedata

_NEWLINES = re.compile(r"\r\n|[\r\u2028\u2029\x0b\x0c\x85]")
_HSPACE = re.compile(r"[^\S\n]+")
_CONTROL = re.compile(r"[\x00-\x08\x0e-\x1f\x7f\ufeff\u200b]")
_BLANKS = re.compile(r"\n{3,}")


def normalise_text(text: str, nfc: bool = True, whitespace: bool = True) -> str:
    if nfc:
        text = unicodedata.normalize("NFC", text)
    if whitespace:
        text = _NEWLINES.sub("\n", text)
        text = _CONTROL.sub("", text)
        text = "\n".join(_HSPACE.sub(" ", line).strip() for line in text.split("\n"))
        text = _BLANKS.sub("\n\n", text).strip()
    return text
