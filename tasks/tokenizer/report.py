"""The tokenizer validation report: compression, exact round trip, and behaviour on code, maths
and non-Latin scripts, for the trained tokenizer and a reference tokenizer side by side.

Definitions used throughout:

- bytes per token: UTF-8 bytes of the text / tokens (higher is better compression).
- tokens per character: tokens / Unicode code points of the text.
- byte-fallback token: a byte-level BPE never emits <unk>; its counterpart of SentencePiece's
  byte fallback is a token whose bytes are not valid UTF-8 on their own, i.e. a lone non-ASCII byte
  or a piece that cuts a multi-byte character (the character is spelled in bytes because no merge
  covers it whole). ASCII single-byte tokens are valid UTF-8 and do not count. The byte-fallback
  fraction is such tokens / all tokens of the sample: about 0 where the merges cover a script,
  about 1 for a script the tokenizer never saw (one token per byte, each a fragment).
- round trip: `decode(encode(text)) == text`, exactly, with no special tokens added or skipped.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from tokenizers import Tokenizer

UNKNOWN = "unknown"  # slice label for a document without source / language


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's reversible byte -> printable character map, inverted (character -> byte).

    Printable Latin-1 bytes map to themselves; the other 68 bytes to U+0100 onwards, in order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


BYTE_OF_CHAR = _byte_level_alphabet()


def fallback_table(tok: Tokenizer) -> list[bool]:
    """Per token id: True when the token's bytes are not valid UTF-8 on their own (see module doc).

    Added (special) tokens are stored as plain text, not byte-level characters: never fallback.
    """
    added = set(tok.get_added_tokens_decoder())
    table = [False] * tok.get_vocab_size(with_added_tokens=True)
    for token, tid in tok.get_vocab(with_added_tokens=True).items():
        if tid in added:
            continue
        try:
            raw = bytes(BYTE_OF_CHAR[c] for c in token)
        except KeyError:
            raise ValueError(f"token {token!r} (id {tid}) is not byte-level: the report needs a byte-level BPE")
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            table[tid] = True
    return table


@dataclass
class Tally:
    """Counts for one slice of text under one tokenizer."""

    docs: int = 0
    chars: int = 0
    bytes: int = 0
    tokens: int = 0
    fallback_tokens: int = 0

    def add(self, text: str, ids: list[int], fallback: list[bool]) -> None:
        self.docs += 1
        self.chars += len(text)
        self.bytes += len(text.encode("utf-8"))
        self.tokens += len(ids)
        self.fallback_tokens += sum(fallback[i] for i in ids)

    def summary(self) -> dict:
        return {
            "tokens": self.tokens,
            "bytes_per_token": round(self.bytes / self.tokens, 4) if self.tokens else None,
            "tokens_per_char": round(self.tokens / self.chars, 4) if self.chars else None,
            "byte_fallback_fraction": round(self.fallback_tokens / self.tokens, 4) if self.tokens else None,
        }


@dataclass
class Measured:
    """One tokenizer under test: its name, the loaded tokenizer and its fallback table."""

    name: str
    tok: Tokenizer
    fallback: list[bool] = field(init=False)

    def __post_init__(self) -> None:
        self.fallback = fallback_table(self.tok)


class SliceTallies:
    """Tallies per (slice, tokenizer), slices like "all", "source:cc", "language:en"."""

    def __init__(self, names: list[str]):
        self.names = names
        self.text: dict[str, dict] = {}  # slice -> {docs, chars, bytes}
        self.by: dict[tuple[str, str], Tally] = {}

    def add(self, slices: list[str], name: str, text: str, ids: list[int], fallback: list[bool]) -> None:
        for s in slices:
            self.by.setdefault((s, name), Tally()).add(text, ids, fallback)

    def rows(self) -> dict[str, dict]:
        out: dict[str, dict] = {}
        for (s, name), t in sorted(self.by.items()):
            row = out.setdefault(s, {"docs": t.docs, "chars": t.chars, "bytes": t.bytes})
            row[name] = t.summary()
        return out


def roundtrip_failures(tok: Tokenizer, ids: list[str], texts: list[str], encodings) -> list[str]:
    """Ids of the documents whose decode(encode(text)) differs from the text."""
    return [doc_id for doc_id, text, enc in zip(ids, texts, encodings)
            if tok.decode(enc.ids, skip_special_tokens=False) != text]


def measure_probes(samples: dict[str, dict], tokenizers: list[Measured], training_lines: dict[str, float]) -> dict:
    """Per category: sample size, share of non-ASCII characters, and per tokenizer tokens/char,
    bytes/token and byte-fallback fraction (see module doc). Unavailable categories keep their reason."""
    out = {}
    for category, sample in samples.items():
        if not sample.get("available"):
            out[category] = {"available": False, "reason": sample.get("reason")}
            continue
        texts = sample["texts"]
        chars = sum(len(t) for t in texts)
        row = {"available": True, "origin": sample.get("origin"), "texts": len(texts), "chars": chars,
               "bytes": sum(len(t.encode("utf-8")) for t in texts),
               "non_ascii_char_fraction": round(sum(ord(c) > 127 for t in texts for c in t) / chars, 4) if chars else 0,
               "lines_seen_in_training": training_lines.get(category)}
        for m in tokenizers:
            tally = Tally()
            for text, enc in zip(texts, m.tok.encode_batch(texts, add_special_tokens=False)):
                tally.add(text, enc.ids, m.fallback)
            row[m.name] = tally.summary()
        out[category] = row
    return out


# ------------------------------------------------------------------ probe-overlap with training text

MIN_OVERLAP_LINE = 30  # shorter lines ("}", "return 0;") recur everywhere and say nothing


class LineOverlap:
    """Share of each probe category's lines (>= 30 characters, stripped) that also occur verbatim as
    a line of a training document: how much of a probe the tokenizer may have memorised."""

    def __init__(self, samples: dict[str, dict]):
        self.lines: dict[str, set[int]] = {}
        for category, sample in samples.items():
            if sample.get("available"):
                self.lines[category] = {hash(ln.strip()) for t in sample["texts"] for ln in t.splitlines()
                                        if len(ln.strip()) >= MIN_OVERLAP_LINE}
        self.all = set().union(*self.lines.values()) if self.lines else set()
        self.seen: set[int] = set()

    def feed(self, text: str) -> None:
        if not self.all:
            return
        for ln in text.splitlines():
            ln = ln.strip()
            if len(ln) >= MIN_OVERLAP_LINE:
                h = hash(ln)
                if h in self.all:
                    self.seen.add(h)

    def fractions(self) -> dict[str, float]:
        return {c: round(len(ls & self.seen) / len(ls), 4) if ls else 0.0 for c, ls in self.lines.items()}


# ------------------------------------------------------------------ rendering and metrics

def _fmt(v, digits: int = 3) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def render_markdown(report: dict) -> str:
    tk, ref, val, names = report["tokenizer"], report.get("reference"), report["validation"], report["tokenizers"]
    lines = ["# Tokenizer validation report", ""]
    lines.append(f"- **crucible**: byte-level BPE, vocabulary {tk['vocab_size']:,}, normalizer `{tk['normalizer']}`, "
                 f"split digits `{tk['split_digits']}`, sha256 `{tk['sha256'][:16]}…`")
    if ref:
        lines.append(f"- **reference**: {ref['description']}, vocabulary {ref['vocab_size']:,}, "
                     f"sha256 `{ref['sha256'][:16]}…`")
    tr = report["training"]
    lines.append(f"- training sample: {tr['docs']:,} documents, {tr['bytes']:,} bytes "
                 f"(of {tr['docs_total']:,}; held out for validation {val['docs']:,}, not sampled {tr['docs_unused']:,})")
    if val["docs"]:
        verdict = ("**exact on every one**" if val["roundtrip_ok"]
                   else f"**FAILED on {len(val['roundtrip_failures'])}**: {', '.join(val['roundtrip_failures'][:20])}")
        lines.append(f"- round trip on all {val['docs']:,} held-out documents: {verdict}")
        if ref and "reference_roundtrip_failures" in val:
            lines.append(f"- reference round trip failures: {len(val['reference_roundtrip_failures'])}")
    else:
        lines.append("- round trip: **not checked** — no document fell into the held-out set "
                     "(corpus too small for tokenizer.validation_fraction)")
    lines += ["", "## Compression on held-out curated documents (bytes per token; higher is better)", ""]
    head = "| slice | docs | bytes | " + " | ".join(f"{n} tokens | {n} bytes/token" for n in names) + " |"
    lines += [head, "|" + "---|" * (3 + 2 * len(names))]
    for s, row in val["slices"].items():
        cells = [s, _fmt(row["docs"]), _fmt(row["bytes"])]
        for n in names:
            cells += [_fmt(row.get(n, {}).get("tokens")), _fmt(row.get(n, {}).get("bytes_per_token"))]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Code, mathematics and non-Latin scripts (samples from shared data)", ""]
    head = ("| category | chars | non-ASCII chars | lines also in training | "
            + " | ".join(f"{n} tokens/char | {n} bytes/token | {n} byte-fallback" for n in names) + " |")
    lines += [head, "|" + "---|" * (4 + 3 * len(names))]
    missing = []
    for cat, row in report["probes"].items():
        if not row["available"]:
            missing.append(f"- **{cat}**: no real sample — {row['reason']}")
            continue
        cells = [cat, _fmt(row["chars"]), _fmt(row["non_ascii_char_fraction"]), _fmt(row["lines_seen_in_training"])]
        for n in names:
            r = row.get(n, {})
            cells += [_fmt(r.get("tokens_per_char")), _fmt(r.get("bytes_per_token")),
                      _fmt(r.get("byte_fallback_fraction"))]
        lines.append("| " + " | ".join(cells) + " |")
    if missing:
        lines += ["", "Categories without a sample in the data:", *missing]
    lines += ["", "Sample origins:"]
    lines += [f"- {cat}: {row['origin']}" for cat, row in report["probes"].items() if row["available"]]
    lines += ["", "Byte-fallback token: a token whose bytes are not valid UTF-8 on their own (a lone non-ASCII "
              "byte or a piece of a multi-byte character). Lines also in training: share of the sample's lines "
              "(≥ 30 characters) found verbatim in the training documents."]
    return "\n".join(lines) + "\n"


_METRIC_UNSAFE = re.compile(r"[^A-Za-z0-9_\-. /:]")


def report_metrics(report: dict) -> dict[str, float]:
    """Flat numeric metrics for MLflow, e.g. `val.all.crucible.bytes_per_token`,
    `probe.code.reference.byte_fallback_fraction`, `val.roundtrip_failures`."""
    out: dict[str, float] = {"val.docs": report["validation"]["docs"],
                             "val.roundtrip_failures": len(report["validation"]["roundtrip_failures"])}
    for s, row in report["validation"]["slices"].items():
        for n in report["tokenizers"]:
            for k, v in row.get(n, {}).items():
                if isinstance(v, (int, float)):
                    out[f"val.{_METRIC_UNSAFE.sub('_', s)}.{n}.{k}"] = v
    for cat, row in report["probes"].items():
        for n in report["tokenizers"]:
            for k in ("tokens_per_char", "bytes_per_token", "byte_fallback_fraction"):
                v = row.get(n, {}).get(k) if row["available"] else None
                if isinstance(v, (int, float)):
                    out[f"probe.{cat}.{n}.{k}"] = v
    return out


def compression_rows(report: dict) -> list[dict]:
    """The held-out compression table as rows (a Prefect table artifact)."""
    rows = []
    for s, row in report["validation"]["slices"].items():
        r = {"slice": s, "docs": row["docs"], "bytes": row["bytes"]}
        for n in report["tokenizers"]:
            r[f"{n}_bytes_per_token"] = row.get(n, {}).get("bytes_per_token")
        rows.append(r)
    for cat, row in report["probes"].items():
        r = {"slice": f"probe:{cat}", "docs": row.get("texts"), "bytes": row.get("bytes")}
        for n in report["tokenizers"]:
            r[f"{n}_bytes_per_token"] = row.get(n, {}).get("bytes_per_token") if row["available"] else None
        rows.append(r)
    return rows
