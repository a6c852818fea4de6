"""Byte-level BPE tokenizer trained with HF `tokenizers`, streamed from the curated Parquet shards.

Byte-level means every string is representable (no <unk>), and with no normalizer and no added
prefix space `decode(encode(x)) == x` holds exactly. Special tokens (bos, eos, pad) take ids 0, 1, 2.
Training is deterministic: shards are read in the given order and the BPE trainer breaks ties
between equally frequent pairs by the pair itself.
"""
from __future__ import annotations

import json
import logging
import random
import time
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tasks.config import PipelineConfig
from tasks.core.hashing import sha256_file
from tasks.tokenizer.corpus import iter_text_batches

log = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"


def build_empty_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())  # no unk token: byte-level covers every byte
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load tokenizer.json for encoding corpus or user text.

    `encode_special_tokens` is switched on, so a literal "<|endoftext|>" inside a document is
    encoded as ordinary text and never turns into the EOS id (that flag is not saved in the file).
    Special-token ids are inserted by the caller (e.g. EOS after each document).
    """
    tok = Tokenizer.from_file(str(path))
    tok.encode_special_tokens = True
    return tok


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
    """Train byte-level BPE on the shards' `text` column; save `out_dir/tokenizer.json`.

    Returns {"path", "vocab_size", "docs", "bytes", "roundtrip_ok", "roundtrip_docs",
    "bytes_per_token", "bos_id", "eos_id", "pad_id", "sha256", "seconds"}. `bytes_per_token`
    is measured on the round-trip sample (a seeded reservoir sample of documents).
    """
    tcfg = cfg.tokenizer
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shards = [Path(s) for s in shards]
    if not shards:
        raise ValueError("train_tokenizer: no shards given")
    t0 = time.perf_counter()

    counts = {"docs": 0, "bytes": 0}
    sample: list[str] = []
    rng = random.Random(cfg.tokens.seed)

    def batches():
        for texts in iter_text_batches(shards, tcfg.batch_docs):
            for text in texts:
                n = counts["docs"]
                counts["docs"] += 1
                counts["bytes"] += len(text.encode("utf-8"))
                # reservoir sample (Algorithm R) for the round-trip check, deterministic by seed
                if len(sample) < tcfg.roundtrip_sample_docs:
                    sample.append(text)
                elif tcfg.roundtrip_sample_docs:
                    j = rng.randint(0, n)
                    if j < tcfg.roundtrip_sample_docs:
                        sample[j] = text
            yield texts

    specials = [tcfg.bos_token, tcfg.eos_token, tcfg.pad_token]
    if len(set(specials)) != 3:
        raise ValueError(f"special tokens must be distinct: {specials}")
    trainer = trainers.BpeTrainer(
        vocab_size=tcfg.vocab_size,
        min_frequency=tcfg.min_frequency,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok = build_empty_tokenizer()
    tok.train_from_iterator(batches(), trainer=trainer)
    if counts["docs"] == 0:
        raise ValueError(f"train_tokenizer: the shards hold no documents: {[str(s) for s in shards]}")

    path = out_dir / TOKENIZER_FILE
    tok.save(str(path), pretty=False)

    # Round trip on the sample, through the saved file as consumers will load it.
    loaded = load_tokenizer(path)
    n_tokens = n_bytes = 0
    failures = []
    encodings = loaded.encode_batch(sample) if sample else []
    for text, enc in zip(sample, encodings):
        n_tokens += len(enc.ids)
        n_bytes += len(text.encode("utf-8"))
        if loaded.decode(enc.ids, skip_special_tokens=False) != text:
            failures.append(text[:80])
    if failures:
        log.warning("tokenizer round trip failed on %d/%d sampled docs, e.g. %r",
                    len(failures), len(sample), failures[0])

    result = {
        "path": str(path.resolve()),
        "vocab_size": loaded.get_vocab_size(),
        "docs": counts["docs"],
        "bytes": counts["bytes"],
        "roundtrip_ok": not failures,
        "roundtrip_docs": len(sample),
        "bytes_per_token": round(n_bytes / n_tokens, 4) if n_tokens else None,
        **special_token_ids(loaded, cfg),
        "sha256": sha256_file(path),
        "seconds": round(time.perf_counter() - t0, 3),
    }
    stats = {k: v for k, v in result.items() if k not in ("seconds", "path")}  # reproducible file
    (out_dir / "tokenizer_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    log.info("tokenizer: vocab %d from %d docs (%d bytes), %.2f bytes/token, round trip %s",
             result["vocab_size"], result["docs"], result["bytes"], result["bytes_per_token"] or 0,
             "ok" if result["roundtrip_ok"] else "FAILED")
    return result
