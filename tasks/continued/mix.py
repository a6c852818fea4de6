"""The training mix of a continued-pretraining cycle: the cycle's new tokens plus a replay share
sampled from earlier cycles' token shards (Ibrahim et al. 2024, "Simple and Scalable Strategies to
Continually Pre-train LLMs": replay against forgetting).

`build_mix` writes a token index (tasks/tokens/binfile.py layout) whose train split is the new
train split followed by whole documents drawn at random from the pool's train splits until the
replay tokens are `fraction` of the mix; its val split is the new data's (held out, never replayed).
The index's "mix" entry records the pool (every earlier cycle's own token index, then this cycle's,
so the next cycle replays from all of them), the token counts by origin and where the replay
starts, and the tokens per data source (new and replayed; from each index's document sources).
`trained_replay_share` replays the training loader over the samples a run consumed and
measures which share of the tokens it trained on came from the replay part.
"""
from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path
from typing import NamedTuple

import numpy as np

from tasks.core import fs
from tasks.core.hashing import sha256_file
from tasks.core.layout import TOKENS_INDEX_FILE
from tasks.core.signing import SignatureError
from tasks.core.storage import stored
from tasks.tokens.binfile import (SPLIT_FILES, TokensChanged, doc_source_names, listed_copy, load_index,
                                  open_doc_starts, open_split, read_signed_index, write_index)

log = logging.getLogger(__name__)


class MixError(ValueError):
    """A replay pool that cannot be mixed with the new tokens (another tokenizer, no documents)."""


def _signed_bytes(tokens_index: str | Path | None, sha256: str | None) -> tuple[dict, bytes] | None:
    """(the index, its bytes) of `tokens_index` (a local file, or an object-store run's object read
    there) when they hash to `sha256` (a signed record's); None when it is gone or does not (logged as
    refused: a writer of the run directory or the store could have swapped it, and whatever it lists
    would be replayed). Read once: what is checked is what the caller parses."""
    if not tokens_index:
        return None
    if not sha256:
        log.warning("refused: the token index %s has no signed sha256 to be held to", tokens_index)
        return None
    try:
        return read_signed_index(*stored(fs.location(str(tokens_index))), sha256=sha256)
    except (FileNotFoundError, IsADirectoryError):
        return None
    except SignatureError as e:
        log.warning("refused: %s", e)
        return None


def verified_index(tokens_index: str | Path | None, sha256: str | None) -> Path | str | None:
    """`tokens_index` (a Path, or an object-store run's URI) if it hashes to `sha256` (a signed
    record's, e.g. the champion's data.tokens_index_sha256 tag); None otherwise (`_signed_bytes`)."""
    return fs.location(str(tokens_index)) if _signed_bytes(tokens_index, sha256) is not None else None


def vouched_pool(tokens_index: str | Path | None, sha256: str) -> dict[str, str]:
    """{token index: the sha256 a signed chain vouches for} of the per-cycle token indexes behind a
    model trained on `tokens_index`: its mix's pool (each held to the mix's pool_sha256), or the index
    itself when it was not a mix (a model pretrained from scratch); each a path, or the URI of an
    object-store run's index (read there). `sha256`: the signed hash the index must have (e.g. the
    champion's data.tokens_index_sha256 tag); the bytes hashed are the bytes parsed. {} when the index
    is gone or does not hash to it (logged as refused). A mix's pool members must hash to what the mix
    recorded when it was built: one that does not is a MixError naming it (never left out silently); a
    member that is gone is returned, for the caller to name. build_mix holds each member to its hash
    again, on the bytes it mixes."""
    read = _signed_bytes(tokens_index, sha256)
    if read is None:
        return {}
    mix = read[0].get("mix")
    if not mix:
        loc = fs.location(str(tokens_index))
        return {str(loc if fs.is_remote(loc) else loc.resolve()): sha256}
    recorded = mix.get("pool_sha256") or {}
    refused = [p for p in mix["pool"] if fs.is_file(*stored(fs.location(p)))
               and verified_index(p, recorded.get(p)) is None]
    if refused:
        raise MixError(f"the replay pool of {tokens_index} holds token indexes that are not the ones its mix "
                       f"recorded (changed, or from a mix built before pool hashes were kept): {refused}")
    return {str(p): recorded.get(p) or "" for p in mix["pool"]}  # "" (gone, unrecorded): build_mix refuses it


def replay_pool(tokens_index: str | Path | None, sha256: str) -> list[Path | str]:
    """The members of `vouched_pool`, each a Path or an object-store run's URI."""
    return [fs.location(p) for p in vouched_pool(tokens_index, sha256)]


def _zero() -> dict:
    return {"new_tokens": 0, "replay_tokens": 0}


def _documents(index_path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends) token offsets of the train split's documents."""
    starts = np.asarray(open_doc_starts(index_path, "train"), dtype=np.int64)
    ends = np.append(starts[1:], load_index(index_path)["splits"]["train"]["tokens"]).astype(np.int64)
    return starts, ends


def _draw(pool: list[Path], target: int, seed: int) -> list[tuple[int, int, int, int]]:
    """(pool member, start, end, document number) of the replayed documents: a seeded random order over every pool
    document, repeated (a new order each pass) when the pool holds fewer tokens than the target;
    stops at the document that brings the replay closest to the target."""
    docs = [(i, int(a), int(b), k) for i, p in enumerate(pool) for k, (a, b) in enumerate(zip(*_documents(p)))
            if b > a]
    if not docs:
        raise MixError(f"the replay pool has no training documents: {[str(p) for p in pool]}")
    rng = np.random.default_rng([seed, len(docs)])
    chosen, total = [], 0
    while total < target:
        for k in rng.permutation(len(docs)):
            i, a, b, _ = docs[k]
            if total + (b - a) - target > target - total:  # this one overshoots more than stopping undershoots
                return chosen
            chosen.append(docs[k])
            total += b - a
            if total >= target:
                return chosen
    return chosen


class _Readable(NamedTuple):
    local: Path  # an index.json in scratch, naming the verified copies of its train split's files
    sha256: str  # of the index's bytes as read
    at: Path | str  # where the index lies (its held-out split's files are found beside it)
    data: dict  # the index as read (its paths as written)


def _readable(index: Path | str, scratch: Path, vouched: str | None) -> _Readable:
    """`index` (a path, or a store's URI or working-copy path: read where it lives, as `stored` says)
    read once, for build_mix, local or on a store alike: the stack's signature verified on the bytes
    parsed, or with `vouched` (the sha256 a signed chain holds for it: a champion's mix's pool_sha256)
    those bytes must hash to it. Each file its train split lists is copied into `scratch` on the read
    that hashes it and held to the sha256 the index records, and `scratch` gets a copy of the index
    naming the copies: what is checked is what is mixed (a file swapped after its index was written
    is a MixError, never replayed nor signed into the mix)."""
    at, options = stored(fs.location(str(index)))
    try:
        data, raw = read_signed_index(at, options, sha256=vouched)
    except FileNotFoundError as e:
        raise MixError(f"cannot mix the token index {index}: it is gone") from e
    except SignatureError as e:
        raise MixError(f"cannot mix the token index {index}: {e}. build_mix takes an index the stack signed, or "
                       "one a signed record vouches for (a champion's replay pool); re-run the tokens stage to "
                       "write it signed") from e
    train = dict(data["splits"]["train"])
    scratch.mkdir(parents=True, exist_ok=True)
    for key, _ in SPLIT_FILES:
        if train.get(key):
            try:
                listed_copy(data, at, "train", key, scratch / f"train.{key}", options)
            except (TokensChanged, FileNotFoundError) as e:
                raise MixError(f"cannot replay the train split of {index}: {e}") from e
            train[key] = str(scratch / f"train.{key}")
    local = scratch / TOKENS_INDEX_FILE
    local.write_text(json.dumps({**data, "splits": {**data["splits"], "train": train}}))
    return _Readable(local, hashlib.sha256(raw).hexdigest(), at, data)


def _held_out_split(index: dict, where: Path | str) -> dict:
    """The val split's entry of `index` (read from `where`) for the mix: its files named where they lie
    (absolute paths, or URIs on a store): the mix's folder holds none of them."""
    val = {k: index["splits"]["val"][k] for k in ("path", "tokens", "docs", "bytes", "sha256", "doc_starts",
                                                   "doc_starts_sha256", "doc_sources", "doc_sources_sha256")
           if k in index["splits"]["val"]}
    for key, _ in SPLIT_FILES:
        if val.get(key):
            val[key] = str(fs.listed_beside(where, val[key]))
    return val


def build_mix(new_index: str | Path, pool: dict[str, str] | list[Path | str], fraction: float, seed: int,
              out_dir: str | Path) -> dict:
    """Write out_dir/{train.bin, train.doc_starts.npy, index.json}: the new train tokens, then
    replayed documents making up `fraction` of the total. Returns the index (absolute paths) plus
    "index_path". Every pool index must come from the same tokenizer (sha256) as `new_index`.
    `new_index` and the pool's indexes are paths or URIs of an object-store run's indexes, read where
    they live and verified (`_readable`): signed by the stack, or, for a pool given as `vouched_pool`'s
    {index: sha256}, holding the bytes that hash says."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    scratch = out_dir / ".verified-reads"
    vouched = {str(p): h for p, h in pool.items()} if isinstance(pool, dict) else {str(p): None for p in pool}
    try:
        return _build_mix(new_index, vouched, fraction, seed, out_dir, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _build_mix(new_name: str | Path, vouched: dict[str, str | None], fraction: float, seed: int, out_dir: Path,
               scratch: Path) -> dict:
    new_name = fs.location(str(new_name)) if fs.is_remote(str(new_name)) else Path(new_name).resolve()
    new = _readable(new_name, scratch / "new", None)
    members = [(fs.location(p), h) for p, h in vouched.items()]  # a store run's are URIs (a Path would mangle "s3://")
    pool_names = [p for p, _ in members]
    readable = [_readable(p, scratch / f"pool-{i}", h) for i, (p, h) in enumerate(members)]
    new_index, pool = new.local, [r.local for r in readable]
    index = load_index(new_index)
    for name, p in zip(pool_names, pool):
        other = load_index(p)
        if other.get("tokenizer_sha256") != index.get("tokenizer_sha256") or other["dtype"] != index["dtype"]:
            raise MixError(f"cannot replay {name}: its tokens come from tokenizer {other.get('tokenizer_sha256')}, "
                           f"not the cycle's {index.get('tokenizer_sha256')}")
    new_tokens = index["splits"]["train"]["tokens"]
    target = round(new_tokens * fraction / (1 - fraction)) if pool and fraction > 0 else 0
    drawn = _draw(pool, target, seed) if target else []
    dtype = np.dtype(index["dtype"]).newbyteorder("<")
    by_origin = {str(new_name): {"role": "new", "tokens": new_tokens, "docs": index["splits"]["train"]["docs"]}}
    by_source: dict[str, dict] = {}
    new_names = doc_source_names(new_index, "train")
    for name, a, b in zip(new_names, *_documents(new_index)):
        by_source.setdefault(name, _zero())["new_tokens"] += int(b - a)
    train_path, starts_path = out_dir / "train.bin", out_dir / "train.doc_starts.npy"
    new_starts = np.asarray(open_doc_starts(new_index, "train"), dtype=np.int64)
    replay_starts, offset = [], new_tokens
    with open(train_path, "wb") as out:
        with open(index["splits"]["train"]["path"], "rb") as f:
            shutil.copyfileobj(f, out, 1 << 20)
        splits = {i: open_split(p, "train") for i, p in enumerate(pool)}
        sources = {i: doc_source_names(p, "train") for i, p in enumerate(pool)}
        # the mix's source table extends the new index's, so the new val split's source ids stay valid
        names = list(index.get("sources") or [])
        ids = {n: j for j, n in enumerate(names)}
        doc_ids = [ids.setdefault(n, len(ids)) for n in new_names]
        for i, a, b, k in drawn:
            doc_ids.append(ids.setdefault(sources[i][k], len(ids)))
            out.write(np.asarray(splits[i][a:b], dtype=dtype).tobytes())
            replay_starts.append(offset)
            offset += b - a
            entry = by_origin.setdefault(str(pool_names[i]), {"role": "replay", "tokens": 0, "docs": 0})
            entry["tokens"] += b - a
            entry["docs"] += 1
            by_source.setdefault(sources[i][k], _zero())["replay_tokens"] += b - a
    np.save(starts_path, np.concatenate([new_starts, np.asarray(replay_starts, dtype=np.int64)]))
    sources_path = out_dir / "train.doc_sources.npy"
    np.save(sources_path, np.asarray(doc_ids, dtype=np.uint16))
    replay_tokens = offset - new_tokens
    for v in by_source.values():
        v["tokens"] = v["new_tokens"] + v["replay_tokens"]
        v["share"] = v["tokens"] / offset if offset else 0.0
    # the new tokens' own mixture describes only them, not the mix
    mixed = {k: v for k, v in index.items() if k not in ("splits", "by_source", "mixture")}
    mixed["sources"] = list(ids)
    mixed["splits"] = {
        "train": {"path": train_path.name, "tokens": offset, "docs": len(new_starts) + len(replay_starts),
                  "bytes": None, "sha256": sha256_file(train_path), "doc_starts": starts_path.name,
                  "doc_starts_sha256": sha256_file(starts_path), "doc_sources": sources_path.name,
                  "doc_sources_sha256": sha256_file(sources_path)},
        # held-out text of the new data only: it stays where the tokens stage wrote it
        "val": _held_out_split(new.data, new.at),
    }
    members = [str(p) for p in pool_names] + [str(new_name)]
    mixed["mix"] = {"new_index": str(new_name), "pool": members,
                    # what the next cycle's replay_pool checks each member against: the bytes read here
                    "pool_sha256": {**{str(p): r.sha256 for p, r in zip(pool_names, readable)}, str(new_name): new.sha256},
                    "replay_fraction": fraction, "seed": seed, "new_tokens": new_tokens,
                    "replay_tokens": replay_tokens, "replay_target": target, "replay_start": new_tokens,
                    "replay_share": replay_tokens / offset if offset else 0.0, "replay_docs": len(drawn),
                    "by_origin": by_origin, "by_source": dict(sorted(by_source.items()))}
    index_path = out_dir / TOKENS_INDEX_FILE
    write_index(index_path, mixed)  # signed: evaluation and deploy take only the stack's indexes
    result = load_index(index_path)
    result["index_path"] = str(index_path.resolve())
    return result


def trained_replay_share(index_path: str | Path, seq_len: int, seed: int, consumed_samples: int,
                         skip_ranges: list[tuple[int, int]] | None = None) -> dict:
    """Which share of the input tokens a run trained on came from the replay part of its mix: the
    training loader (tasks.train.data.GlobalWindows, same seed and seq_len) replayed over global
    samples [0, consumed_samples) minus the skipped ranges."""
    from tasks.train.data import GlobalWindows

    mix = json.loads(Path(index_path).read_text()).get("mix")
    if not mix:
        return {"trained_tokens": 0, "replay_tokens": 0, "replay_share": 0.0}
    windows = GlobalWindows(index_path, "train", seq_len, 1, seed=seed)
    skipped = [range(a, b) for a, b in skip_ranges or []]
    boundary, total, replay = mix["replay_start"], 0, 0
    for g in range(consumed_samples):
        if any(g in r for r in skipped):
            continue
        s = windows.window_start(g)
        total += seq_len
        replay += max(0, s + seq_len - max(s, boundary))
    return {"trained_tokens": total, "replay_tokens": replay, "replay_share": replay / total if total else 0.0}
