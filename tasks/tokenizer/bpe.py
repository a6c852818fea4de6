"""Byte-level BPE tokenizer trained with HF `tokenizers`, streamed from the curated Parquet shards.

Byte-level means every string is representable (no <unk>), and with no lossy normalizer and no
added prefix space `decode(encode(x)) == x` holds exactly. Special tokens (bos, eos, pad) take ids
0, 1, 2. Training is deterministic: shards are read in the given order, the held-out and sampled
documents are chosen by a hash of the document id, and the BPE trainer breaks ties between equally
frequent pairs by the pair itself.

A share of the documents (`tokenizer.validation_fraction`) is held out of training; after training
every held-out document must round-trip exactly (else `TokenizerValidationError` names them), and
the validation report (tasks/tokenizer/report.py) compares the tokenizer with HF's stock
ByteLevelBPETokenizer trained on the same sample: tokenizer_report.json and .md in the output dir.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

from tokenizers import ByteLevelBPETokenizer, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from tasks.core.layout import TOKENIZER_FILE
from tasks.config import PipelineConfig, TokenizerConfig
from tasks.core.fs import read_bytes
from tasks.core.hashing import sha256_file
from tasks.tokenizer.corpus import iter_doc_columns
from tasks.tokenizer.probes import load_probe_samples
from tasks.tokenizer.report import (
    UNKNOWN,
    LineOverlap,
    Measured,
    SliceTallies,
    measure_probes,
    render_markdown,
    roundtrip_failures,
)

log = logging.getLogger(__name__)

REFERENCE_FILE = "reference_tokenizer.json"
REPORT_FILE = "tokenizer_report.json"
REPORT_MARKDOWN = "tokenizer_report.md"
REFERENCE_DESCRIPTION = ("HF tokenizers' stock ByteLevelBPETokenizer (default ByteLevel pre-tokenisation, "
                         "no normalizer), same vocabulary size, min_frequency, special tokens and training documents")


class TokenizerValidationError(ValueError):
    """Held-out documents did not round-trip; the message lists their ids (all of them in the report)."""


def build_empty_tokenizer(tcfg: TokenizerConfig | None = None) -> Tokenizer:
    tcfg = tcfg or TokenizerConfig()
    tok = Tokenizer(models.BPE())  # no unk token: byte-level covers every byte
    if tcfg.normalizer == "nfc":
        tok.normalizer = normalizers.NFC()
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    # Digits first: "2024" becomes four pre-tokens, so no merge can join digits (Llama/PaLM style).
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if tcfg.split_digits else byte_level)
    tok.decoder = decoders.ByteLevel()
    return tok


def _unit(salt: str, key: str) -> float:
    """A stable number in [0, 1) from a key (same on every machine and Python run)."""
    return int.from_bytes(hashlib.blake2b(f"{salt}:{key}".encode(), digest_size=8).digest(), "big") / 2 ** 64


def doc_key(doc_id: str | None, text: str) -> str:
    """The id a document is held out and reported by (a text hash when the shard has no ids)."""
    return doc_id if doc_id is not None else "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def split_of(key: str, tcfg: TokenizerConfig) -> str:
    """"validation" (held out), "train" (in the sample) or "unused" (outside the sample)."""
    if _unit("tokenizer-validation", key) < tcfg.validation_fraction:
        return "validation"
    if tcfg.sample_fraction >= 1 or _unit("tokenizer-sample", key) < tcfg.sample_fraction:
        return "train"
    return "unused"


def load_tokenizer(path: str | Path, storage_options: dict | None = None,
                   expected_sha256: str | None = None) -> Tokenizer:
    """Load tokenizer.json for encoding corpus or user text; with `expected_sha256` the file's bytes
    must hash to it (ValueError otherwise).

    `encode_special_tokens` is switched on, so a literal "<|endoftext|>" inside a document is
    encoded as ordinary text and never turns into the EOS id (that flag is not saved in the file).
    Special-token ids are inserted by the caller (e.g. EOS after each document).
    """
    return read_tokenizer(path, storage_options, expected_sha256)[0]


def read_tokenizer(path: str | Path, storage_options: dict | None = None,
                   expected_sha256: str | None = None) -> tuple[Tokenizer, str]:
    """(`load_tokenizer`, the sha256 of the bytes it parsed). The file is read once: a hash taken by a
    second read could be of other bytes than the ones loaded (a file swapped in between). On a store
    (an object-store run read where it lives) the object is read by fsspec with `storage_options`."""
    data = read_bytes(path, storage_options)
    digest = hashlib.sha256(data).hexdigest()
    if expected_sha256 is not None and digest != expected_sha256:
        raise ValueError(f"tokenizer {path} is not the one the checkpoint was trained with "
                         f"(sha256 {digest[:16]}..., not {expected_sha256[:16]}...)")
    tok = Tokenizer.from_str(data.decode("utf-8"))
    tok.encode_special_tokens = True
    return tok, digest


def special_token_ids(tok: Tokenizer, cfg: PipelineConfig) -> dict[str, int]:
    out = {}
    for name in ("bos", "eos", "pad"):
        token = getattr(cfg.tokenizer, f"{name}_token")
        tid = tok.token_to_id(token)
        if tid is None:
            raise ValueError(f"tokenizer has no {name} token {token!r}")
        out[f"{name}_id"] = tid
    return out


def train_tokenizer(cfg: PipelineConfig, shards: list[Path], out_dir: Path) -> dict:
    """Train byte-level BPE on the shards' `text` column (minus the held-out documents); save
    `out_dir/tokenizer.json`, validate it and write the report (module doc).

    Returns {"path", "vocab_size", "docs" (trained on), "bytes", "docs_total", "validation_docs",
    "roundtrip_ok", "roundtrip_docs", "bytes_per_token" (held-out), "reference_bytes_per_token",
    "report_path", "report_markdown_path", "reference_path", "bos_id", "eos_id", "pad_id",
    "sha256", "seconds"}. Raises TokenizerValidationError (after writing the report) when any
    held-out document does not round-trip.
    """
    tcfg = cfg.tokenizer
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shards = [Path(s) for s in shards]
    specials = _special_tokens(tcfg, shards)
    t0 = time.perf_counter()

    probes = load_probe_samples(cfg)
    overlap = LineOverlap(probes)
    counts = {"validation": 0, "train": 0, "unused": 0, "bytes": 0}
    tok = build_empty_tokenizer(tcfg)
    tok.train_from_iterator(training_batches(shards, tcfg, counts, overlap),
                            trainer=trainers.BpeTrainer(vocab_size=tcfg.vocab_size, min_frequency=tcfg.min_frequency,
                                                        special_tokens=specials,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    counts["total"] = _check_counts(counts, shards, tcfg)
    path = out_dir / TOKENIZER_FILE
    tok.save(str(path), pretty=False)

    measured = [Measured("crucible", load_tokenizer(path))]  # as consumers will load it
    ref_path = None
    if tcfg.reference:
        ref_path = train_reference(tcfg, specials, shards, out_dir / REFERENCE_FILE)
        measured.append(Measured("reference", load_tokenizer(ref_path)))

    validation = validate_held_out(shards, tcfg, measured)
    report = build_report(tcfg, measured, path, ref_path, counts, validation,
                          measure_probes(probes, measured, overlap.fractions()))
    report_path, md_path = out_dir / REPORT_FILE, out_dir / REPORT_MARKDOWN
    report_path.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    md_path.write_text(render_markdown(report))
    _raise_on_roundtrip_failures(validation, report_path)

    overall = validation["slices"].get("all", {})
    result = {
        "path": str(path.resolve()),
        "vocab_size": measured[0].tok.get_vocab_size(),
        "docs": counts["train"],
        "bytes": counts["bytes"],
        "docs_total": counts["total"],
        "validation_docs": validation["docs"],
        "roundtrip_ok": validation["roundtrip_ok"],
        "roundtrip_docs": validation["docs"],
        "bytes_per_token": overall.get("crucible", {}).get("bytes_per_token"),
        "reference_bytes_per_token": overall.get("reference", {}).get("bytes_per_token"),
        "report_path": str(report_path.resolve()),
        "report_markdown_path": str(md_path.resolve()),
        "reference_path": str(ref_path.resolve()) if ref_path else None,
        **special_token_ids(measured[0].tok, cfg),
        "sha256": sha256_file(path),
        "seconds": round(time.perf_counter() - t0, 3),
    }
    stats = {k: v for k, v in result.items() if k not in ("seconds",) and not k.endswith("path")}
    (out_dir / "tokenizer_stats.json").write_text(json.dumps(stats, indent=2) + "\n")  # reproducible file
    log.info("tokenizer: vocab %d from %d docs (%d bytes); held out %d docs, all round-trip; %.2f bytes/token "
             "(reference %s)", result["vocab_size"], result["docs"], result["bytes"], result["validation_docs"],
             result["bytes_per_token"] or 0, result["reference_bytes_per_token"])
    return result


def _special_tokens(tcfg: TokenizerConfig, shards: list[Path]) -> list[str]:
    """[bos, eos, pad]; raises ValueError on no shards or special tokens that are not distinct."""
    if not shards:
        raise ValueError("train_tokenizer: no shards given")
    specials = [tcfg.bos_token, tcfg.eos_token, tcfg.pad_token]
    if len(set(specials)) != 3:
        raise ValueError(f"special tokens must be distinct: {specials}")
    return specials


def training_batches(shards: list[Path], tcfg: TokenizerConfig, counts: dict | None = None,
                     overlap: LineOverlap | None = None):
    """The training sample's texts, in batches. With `counts` (and `overlap`), the pass also
    tallies the documents of each split and the sample's bytes (and feeds the probe overlap)."""
    for cols in iter_doc_columns(shards, ["id"], tcfg.batch_docs):
        batch = []
        for doc_id, text in zip(cols["id"], cols["text"]):
            part = split_of(doc_key(doc_id, text), tcfg)
            if counts is not None:
                counts[part] += 1
            if part == "train":
                batch.append(text)
                if counts is not None:
                    counts["bytes"] += len(text.encode("utf-8"))
                    overlap.feed(text)
        if batch:
            yield batch


def _check_counts(counts: dict, shards: list[Path], tcfg: TokenizerConfig) -> int:
    """The number of documents read; raises ValueError when none, or none was left to train on."""
    docs_total = counts["validation"] + counts["train"] + counts["unused"]
    if docs_total == 0:
        raise ValueError(f"train_tokenizer: the shards hold no documents: {[str(s) for s in shards]}")
    if counts["train"] == 0:
        raise ValueError(f"train_tokenizer: no training documents left: all {docs_total} were held out or "
                         f"not sampled (validation_fraction {tcfg.validation_fraction}, "
                         f"sample_fraction {tcfg.sample_fraction})")
    return docs_total


def train_reference(tcfg: TokenizerConfig, specials: list[str], shards: list[Path], path: Path) -> Path:
    """HF's stock ByteLevelBPETokenizer on the same sample and settings, saved to `path`."""
    reference = ByteLevelBPETokenizer()
    reference.train_from_iterator(training_batches(shards, tcfg), vocab_size=tcfg.vocab_size,
                                  min_frequency=tcfg.min_frequency, special_tokens=specials,
                                  show_progress=False)
    reference.save(str(path), pretty=False)
    return path


def build_report(tcfg: TokenizerConfig, measured: list[Measured], path: Path, ref_path: Path | None,
                 counts: dict, validation: dict, probes: dict) -> dict:
    """tokenizer_report.json's content (module doc)."""
    return {
        "tokenizers": [m.name for m in measured],
        "tokenizer": {"path": str(path.resolve()), "vocab_size": measured[0].tok.get_vocab_size(),
                      "sha256": sha256_file(path), "normalizer": tcfg.normalizer, "split_digits": tcfg.split_digits},
        "reference": ({"path": str(ref_path.resolve()), "description": REFERENCE_DESCRIPTION,
                       "vocab_size": measured[1].tok.get_vocab_size(), "sha256": sha256_file(ref_path)}
                      if ref_path else None),
        "training": {"docs": counts["train"], "bytes": counts["bytes"], "docs_total": counts["total"],
                     "docs_unused": counts["unused"], "validation_fraction": tcfg.validation_fraction,
                     "sample_fraction": tcfg.sample_fraction},
        "validation": validation,
        "probes": probes,
    }


def _raise_on_roundtrip_failures(validation: dict, report_path: Path) -> None:
    failures = validation["roundtrip_failures"]
    if failures:
        shown = ", ".join(failures[:50]) + (f" and {len(failures) - 50} more" if len(failures) > 50 else "")
        raise TokenizerValidationError(
            f"tokenizer round trip failed on {len(failures)} of {validation['docs']} held-out documents "
            f"(decode(encode(text)) != text): {shown}; full list in {report_path}")


def validate_held_out(shards: list[Path], tcfg: TokenizerConfig, measured: list[Measured]) -> dict:
    """Encode every held-out document with each tokenizer: compression per slice (all, source:…,
    language:…) and the exact round trip (the first tokenizer's failures decide the stage)."""
    tallies = SliceTallies([m.name for m in measured])
    failures: dict[str, list[str]] = {m.name: [] for m in measured}
    docs = 0
    for cols in iter_doc_columns(shards, ["id", "source", "language"], tcfg.batch_docs):
        keys, texts, slices = [], [], []
        for doc_id, text, source, language in zip(cols["id"], cols["text"], cols["source"], cols["language"]):
            key = doc_key(doc_id, text)
            if split_of(key, tcfg) != "validation":
                continue
            keys.append(key)
            texts.append(text)
            slices.append(["all", f"source:{source or UNKNOWN}", f"language:{language or UNKNOWN}"])
        if not texts:
            continue
        docs += len(texts)
        for m in measured:
            encodings = m.tok.encode_batch(texts, add_special_tokens=False)
            failures[m.name] += roundtrip_failures(m.tok, keys, texts, encodings)
            for text, enc, sl in zip(texts, encodings, slices):
                tallies.add(sl, m.name, text, enc.ids, m.fallback)
    if docs == 0 and tcfg.validation_fraction > 0:
        log.warning("tokenizer: no document fell into the held-out set (validation_fraction %s): "
                    "round trip and compression not measured", tcfg.validation_fraction)
    main = measured[0].name
    out = {"docs": docs, "roundtrip_ok": not failures[main], "roundtrip_failures": failures[main],
           "slices": tallies.rows()}
    for m in measured[1:]:
        out[f"{m.name}_roundtrip_failures"] = failures[m.name]
    return out
