"""Tokens stage: encode the curated corpus into flat train/val token files.

Every document is followed by one EOS id; `<split>.doc_starts.npy` records where each document
starts (for document-aware attention masks in training). Documents go to train or val by a hash of
(seed, document id), so a document is never split across the two and the split does not
depend on shard order or on the other documents. The corpus streams batch by batch. Then the
sources' `mixture_weight`s up- or down-sample the train split's whole documents (seeded; the val
split is not weighted; tasks/tokens/mixture.py); with every weight 1 nothing is resampled.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from array import array
from pathlib import Path

import numpy as np

from tasks.config import PipelineConfig
from tasks.core.fs import StorageError, copy_checked, is_remote, location, read_bytes, write_bytes
from tasks.core.hashing import sha256_file, sha256_text
from tasks.core.storage import read_location, remove_run_tree, stored
from tasks.tokenizer.bpe import load_tokenizer, read_tokenizer
from tasks.tokenizer.corpus import iter_doc_columns
from tasks.core.layout import TOKENS_INDEX_FILE
from tasks.tokens.binfile import UNKNOWN_SOURCE, dtype_for_vocab, write_index, write_llmc
from tasks.tokens.mixture import DROP_REASON, plan_mixture, write_weighted_split

log = logging.getLogger(__name__)

SPLITS = ("train", "val")


def is_val_doc(doc_key: str, val_fraction: float, seed: int) -> bool:
    """Deterministic split: the first 64 bits of sha256("seed\\0key") as a fraction of 2**64."""
    h = int(sha256_text(f"{seed}\0{doc_key}")[:16], 16)
    return h / 2.0**64 < val_fraction


def encode_shard(tokenizer_path: str, shard: str, eos_token: str, batch_docs: int,
                 val_fraction: float, seed: int, part_prefix: str, tokenizer_sha256: str | None = None) -> dict:
    """Encode one shard into `<part_prefix>.<split>.bin` files (EOS after every document).

    Returns per split the token/doc/byte counts and each document's token length, so the caller
    can concatenate the parts in shard order and derive document start offsets. Runs in-process
    or as a Ray task; both give the same bytes.
    """
    # the run's parts/tokenizer.json (staged on another node: the store's object), held to the hash
    # of the bytes the driver read: a swapped object would encode ids the index does not mean
    tok = load_tokenizer(tokenizer_path, expected_sha256=tokenizer_sha256)
    eos_id = tok.token_to_id(eos_token)
    dtype = dtype_for_vocab(tok.get_vocab_size())
    stats = {s: {"tokens": 0, "docs": 0, "bytes": 0} for s in SPLITS}
    doc_lens = {s: array("q") for s in SPLITS}
    sources: dict[str, int] = {}  # source name -> local id (UNKNOWN_SOURCE for a document without one)
    doc_sources = {s: array("H") for s in SPLITS}
    doc_bytes = {s: array("q") for s in SPLITS}  # UTF-8 bytes per document (a weighted split's byte count)
    paths = {s: f"{part_prefix}.{s}.bin" for s in SPLITS}
    files = {s: open(paths[s], "wb") for s in SPLITS}
    try:
        for batch in iter_doc_columns([shard], ["id", "source"], batch_docs):
            texts = batch["text"]
            keys = [str(k) if k is not None else "sha256:" + sha256_text(t) for k, t in zip(batch["id"], texts)]
            encodings = tok.encode_batch(texts, add_special_tokens=False)
            chunks: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
            for key, text, enc, source in zip(keys, texts, encodings, batch["source"]):
                split = "val" if is_val_doc(key, val_fraction, seed) else "train"
                arr = np.empty(len(enc.ids) + 1, dtype=dtype)
                arr[:-1] = enc.ids
                arr[-1] = eos_id
                chunks[split].append(arr)
                doc_lens[split].append(arr.size)
                doc_sources[split].append(sources.setdefault(source or UNKNOWN_SOURCE, len(sources)))
                stats[split]["tokens"] += arr.size
                stats[split]["docs"] += 1
                doc_bytes[split].append(len(text.encode("utf-8")))
                stats[split]["bytes"] += doc_bytes[split][-1]
            for s in SPLITS:
                if chunks[s]:
                    np.concatenate(chunks[s]).tofile(files[s])
    finally:
        for f in files.values():
            f.close()
    return {"paths": paths, "stats": stats, "doc_lens": {s: doc_lens[s].tobytes() for s in SPLITS},
            "sources": list(sources), "doc_sources": {s: doc_sources[s].tobytes() for s in SPLITS},
            "doc_bytes": {s: doc_bytes[s].tobytes() for s in SPLITS}, "pid": os.getpid()}


def _job_tokenizer(tokenizer: str | Path, parts_dir: Path, expected_sha256: str | None = None) -> Path:
    """The tokenizer's bytes, read once where they lie (a path, or a store's object by its URI: the
    champion's of an object-store run; a Path would make 's3://' 's3:/'), as parts_dir/tokenizer.json:
    the one file every encoding job and the index's tokenizer_sha256 read (so all see the same bytes).
    In a store's working copy its object too, which jobs on other nodes download. `expected_sha256` (a
    continued cycle's: the champion's signed tokenizer_sha256): those bytes must have it, else ValueError
    (a writer of the champion's run folder could swap in a tokenizer whose ids mean something else)."""
    data = read_bytes(*stored(location(tokenizer)))
    if expected_sha256 is not None and (digest := hashlib.sha256(data).hexdigest()) != expected_sha256:
        raise ValueError(f"refused: tokenizer {tokenizer} is not the champion's (sha256 {digest[:16]}..., not the "
                         f"signed {expected_sha256[:16]}...): the cycle encodes only with the tokenizer it continues")
    local = parts_dir / "tokenizer.json"
    local.write_bytes(data)
    at, options = stored(local)
    if is_remote(at):
        write_bytes(at, data, options)
    return local


def _encode_all(cfg: PipelineConfig, tokenizer_path: Path, shards: list[Path],
                parts_dir: Path, tokenizer_sha256: str) -> tuple[list[dict], dict[str, int]]:
    """Encode every shard, on Ray when configured and there is more than one shard, each job with
    the tokenizer whose bytes have `tokenizer_sha256`. Returns the parts in shard order and the jobs
    run per Ray node ({} in process)."""
    tcfg = cfg.tokens
    jobs = [(str(tokenizer_path), str(shard), cfg.tokenizer.eos_token, tcfg.batch_docs,
             tcfg.val_fraction, tcfg.seed, str(parts_dir / f"part-{i:05d}"), tokenizer_sha256)
            for i, shard in enumerate(shards)]
    if not tcfg.ray or len(jobs) < 2:
        return [encode_shard(*job) for job in jobs], {}
    from tasks.core.executor import Job, JobRunner, RayTasks

    results: dict[str, dict] = {}
    with JobRunner(RayTasks(encode_shard, cfg.ray)) as runner:
        for i, args in enumerate(jobs):
            runner.submit(Job(f"{i:05d}", None, args))
        for job, result in runner.finished():  # a part left on the store keeps the sha256 its job reported
            results[job.name] = {**result, "sha256": {s: runner.written[p] for s, p in result["paths"].items()
                                                      if p in runner.written}}
    return [results[f"{i:05d}"] for i in range(len(jobs))], runner.node_report()  # in shard order


def _concatenate(parts: list[dict], paths: dict, starts_paths: dict, sources_paths: dict
                 ) -> tuple[dict, list[str], dict]:
    """Concatenate the encoded parts in shard order into each split's token file, document starts
    and document sources (ids into one sorted source table for the run). Returns (stats per split,
    source names, tokens and documents per source and split)."""
    stats = {s: {"tokens": 0, "docs": 0, "bytes": 0} for s in SPLITS}
    doc_starts: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
    source_names = sorted({name for part in parts for name in part["sources"]})
    source_id = {name: i for i, name in enumerate(source_names)}
    by_source = {name: {s: {"tokens": 0, "docs": 0} for s in SPLITS} for name in source_names}
    for s in SPLITS:
        doc_source_ids = []
        with open(paths[s], "wb") as out:
            for part in parts:
                lens = np.frombuffer(part["doc_lens"][s], dtype=np.int64)
                local = np.frombuffer(part["doc_sources"][s], dtype=np.uint16)
                ids = np.asarray([source_id[n] for n in part["sources"]], dtype=np.uint16)[local] \
                    if local.size else local
                doc_source_ids.append(ids)
                for i, n in zip(*np.unique(ids, return_counts=True)):
                    by_source[source_names[i]][s]["docs"] += int(n)
                    by_source[source_names[i]][s]["tokens"] += int(lens[ids == i].sum())
                doc_starts[s].append(stats[s]["tokens"] + np.concatenate(([0], np.cumsum(lens)[:-1]))
                                     if lens.size else lens)
                for key in stats[s]:
                    stats[s][key] += part["stats"][s][key]
                # a part a job on another node left on the store is read there, held to the sha256
                # the job reported on the read that copies it
                at, options = read_location(part["paths"][s])
                sha = part.get("sha256", {}).get(s)
                if sha is None and is_remote(at):
                    raise StorageError(f"{at}: a token part on the store with no sha256 from its job")
                copy_checked(at, out, sha, options)
        np.save(starts_paths[s], np.concatenate(doc_starts[s]).astype(np.int64) if doc_starts[s]
                else np.zeros(0, dtype=np.int64))
        np.save(sources_paths[s], np.concatenate(doc_source_ids).astype(np.uint16) if doc_source_ids
                else np.zeros(0, dtype=np.uint16))
    return stats, source_names, by_source


def _weight_train_split(cfg: PipelineConfig, files: tuple[dict, dict, dict], parts: list[dict], stats: dict,
                        by_source: dict, source_names: list[str], dtype: np.dtype) -> dict:
    """Apply the sources' mixture weights to the train split (tasks/tokens/mixture.py), updating its
    counts in `stats` and `by_source`; the val split is never weighted. Returns the index's "mixture"."""
    paths, starts_paths, sources_paths = (f["train"] for f in files)
    starts, ids = np.load(starts_paths), np.load(sources_paths)
    lens = np.diff(np.append(starts, stats["train"]["tokens"]))
    weights = {s.name: s.mixture_weight for s in cfg.sources}
    plan = plan_mixture(lens, ids, source_names, weights, cfg.tokens.mixture_seed)
    if plan.applied:  # else nothing is rewritten: the files stay those of an unweighted build
        write_weighted_split(plan, paths, starts_paths, sources_paths, starts, ids, dtype)
        doc_bytes = np.concatenate([np.frombuffer(p["doc_bytes"]["train"], dtype=np.int64) for p in parts])
        stats["train"].update(tokens=int((plan.copies * lens).sum()), docs=len(plan.order),
                              bytes=int((plan.copies * doc_bytes).sum()))
        for name, v in plan.by_source.items():
            by_source[name]["train"] = {"tokens": v["tokens"], "docs": v["docs"]}
    dropped = sum(v["dropped_docs"] for v in plan.by_source.values())
    return {"split": "train", "seed": cfg.tokens.mixture_seed, "applied": plan.applied,
            "by_source": plan.by_source, "dropped": {DROP_REASON: dropped} if dropped else {}}


def prepare_tokens(cfg: PipelineConfig, tokenizer: str | Path, shards: list[Path], out_dir: Path,
                   expected_sha256: str | None = None) -> dict:
    """Encode shards into out_dir/{train,val}.bin and out_dir/index.json.

    Shards are encoded in parallel (one Ray task each, `tokens.ray`) into part files, then
    concatenated in shard order, so the output does not depend on the number of workers.
    Returns the index dict (with absolute split paths) plus "index_path". A document without an
    `id` is keyed by the sha256 of its text. Documents sharing an id land in the same split.
    `expected_sha256`: the tokenizer's bytes must hash to it (a continued cycle: the champion's).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    parts_dir = out_dir / "parts"
    shutil.rmtree(parts_dir, ignore_errors=True)
    parts_dir.mkdir()
    tokenizer_path = _job_tokenizer(tokenizer, parts_dir, expected_sha256)
    tok, tokenizer_sha256 = read_tokenizer(tokenizer_path, expected_sha256=expected_sha256)
    vocab_size = tok.get_vocab_size()
    eos_id = tok.token_to_id(cfg.tokenizer.eos_token)
    if eos_id is None:
        raise ValueError(f"tokenizer {tokenizer} has no EOS token {cfg.tokenizer.eos_token!r}")
    dtype = dtype_for_vocab(vocab_size)
    tcfg = cfg.tokens
    t0 = time.perf_counter()

    parts, nodes = _encode_all(cfg, tokenizer_path, [Path(s) for s in shards], parts_dir, tokenizer_sha256)

    paths, starts_paths, sources_paths = ({s: out_dir / f"{s}{suffix}" for s in SPLITS}
                                          for suffix in (".bin", ".doc_starts.npy", ".doc_sources.npy"))
    stats, source_names, by_source = _concatenate(parts, paths, starts_paths, sources_paths)
    mixture = _weight_train_split(cfg, (paths, starts_paths, sources_paths), parts, stats, by_source,
                                  source_names, dtype)
    remove_run_tree(parts_dir)  # a store run's: also what jobs on other nodes left there
    total_docs = sum(stats[s]["docs"] for s in SPLITS)
    if total_docs == 0:
        raise ValueError(f"prepare_tokens: the shards hold no documents: {[str(s) for s in shards]}")
    if stats["val"]["docs"] == 0:
        log.warning("tokens: the val split is empty (%d docs, val_fraction %.3f)", total_docs, tcfg.val_fraction)

    index = {
        "dtype": dtype.name,  # "uint16" / "uint32", always little-endian
        "byteorder": "little",
        "vocab_size": vocab_size,
        "eos_id": eos_id,
        "tokenizer_sha256": tokenizer_sha256,
        "val_fraction": tcfg.val_fraction,
        "seed": tcfg.seed,
        "splits": {
            s: {"path": paths[s].name, **stats[s], "sha256": sha256_file(paths[s]),
                "doc_starts": starts_paths[s].name, "doc_starts_sha256": sha256_file(starts_paths[s]),
                "doc_sources": sources_paths[s].name, "doc_sources_sha256": sha256_file(sources_paths[s])}
            for s in SPLITS
        },
        # doc_sources[i] indexes this list; tokens and documents per source and split
        "sources": source_names,
        "by_source": by_source,
        # the sources' mixture weights on the train split: per source its natural and written
        # documents and tokens, target and effective token share, documents dropped and repeated
        "mixture": mixture,
    }
    if tcfg.llmc:  # the same tokens again, behind llm.c's header (llm.c refuses an empty file)
        for s in [s for s in SPLITS if stats[s]["tokens"]]:
            llmc = write_llmc(paths[s], dtype, out_dir / f"{s}.llmc.bin")
            index["splits"][s].update(llmc_path=llmc.name, llmc_sha256=sha256_file(llmc))
    index_path = out_dir / TOKENS_INDEX_FILE
    write_index(index_path, index)
    for s in SPLITS:
        index["splits"][s]["path"] = str(paths[s].resolve())
        index["splits"][s]["doc_starts"] = str(starts_paths[s].resolve())
        index["splits"][s]["doc_sources"] = str(sources_paths[s].resolve())
        if index["splits"][s].get("llmc_path"):
            index["splits"][s]["llmc_path"] = str((out_dir / index["splits"][s]["llmc_path"]).resolve())
    index["index_path"] = str(index_path.resolve())
    index["seconds"] = round(time.perf_counter() - t0, 3)
    # shards encoded by other processes (Ray workers); not in index.json, which holds only the data
    index["shards_encoded_elsewhere"] = sum(part["pid"] != os.getpid() for part in parts)
    index["nodes"] = nodes  # encoding jobs run per Ray node
    log.info("tokens: train %d tokens / %d docs, val %d tokens / %d docs (%s) in %.1fs",
             stats["train"]["tokens"], stats["train"]["docs"], stats["val"]["tokens"],
             stats["val"]["docs"], dtype.name, index["seconds"])
    return index
