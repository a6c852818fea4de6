"""Text-test helpers shared by the normalisation tests."""
from __future__ import annotations

from typing import Callable


def assert_same_on_every_code_point(fn: Callable[[str], object], reference: Callable[[str], object]) -> None:
    """`fn` and `reference` agree on every code point from U+0020 to U+10FFFF (surrogates and
    unassigned ones included), one string per 64 Ki block."""
    seen = 0
    for lo in range(0x20, 0x110000, 0x10000):
        text = "".join(map(chr, range(lo, min(lo + 0x10000, 0x110000))))
        seen += len(text)
        assert fn(text) == reference(text), f"block U+{lo:04X}"
    assert seen == 0x110000 - 0x20
