"""Exact-substring dedup (Lee et al. 2022, "Deduplicating Training Data Makes Language Models
Better"): every span of at least `min_tokens` tokens that occurred earlier in the corpus is cut
out of the text; the first occurrence stays.

Tokens are whitespace-separated words (`str.split()`), not BPE tokens: curation runs before
the tokenizer exists, a cut between words never splits a word or a UTF-8 character, and words are
what the Gopher minimum counts. 50 words are ~65 GPT-2 tokens, so the default is a little more
conservative than the paper's 50 BPE tokens.

Sharding: the curated documents, in corpus order, are cut into groups of consecutive documents of
at most `max_bytes_per_process` UTF-8 text bytes (a bigger document is a group alone), planned by
one Ray task that streams the text lengths. One Ray task per group reads its rows, builds a
suffix array (`pydivsufsort`) over the word ids of its documents joined by separators unique to
each document (so no match crosses a document boundary) and its LCP array, and marks every
`min_tokens`-word window whose suffix has an earlier occurrence (the smallest position of its run
of suffixes sharing ≥ `min_tokens` words); the marked windows' union is removed. A repeat of L ≥
`min_tokens` words thus loses all its words at every occurrence but the first. Limit: repeats are
found within a group, not across groups (the deduplicate-text-datasets tool's cross-file pass is
not done); with the whole corpus under `max_bytes_per_process` the result is exact.

A document that lost text and has fewer than `min_words` words left is dropped with the reason
"substring_dedup_too_short"; the others are written with their shortened text. Each group task
writes its rows per curated shard slice and its drops (dropped.jsonl lines); one task per curated
shard then replaces the shard with its slices, in order. The driver holds counters and paths only.
The output depends on the groups only, never on how many workers ran them.
"""
from __future__ import annotations

import json
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tasks.config import SubstringDedupConfig
from tasks.core.steps import StepStats

STEP = "substring_dedup"
TOO_SHORT = "substring_dedup_too_short"
_WORD = re.compile(r"\S+")  # the words str.split() gives (the same Unicode whitespace), with offsets


def plan_groups(shards: list[str], max_bytes: int) -> list[list[tuple[int, int, int]]]:
    """Ray task: consecutive (shard, first row, end row) slices, ≤ `max_bytes` text bytes a group."""
    groups: list[list[tuple[int, int, int]]] = []
    cur: list[tuple[int, int, int]] = []
    size = 0
    for s, path in enumerate(shards):
        row = start = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=4096, columns=["text"]):
            for n in pc.binary_length(batch.column(0)).to_numpy(zero_copy_only=False):
                if size > 0 and size + n > max_bytes:  # close the group before this document
                    if row > start:
                        cur.append((s, start, row))
                    groups.append(cur)
                    cur, size, start = [], 0, row
                size += int(n)
                row += 1
        if row > start:
            cur.append((s, start, row))
    if cur:
        groups.append(cur)
    return groups


def repeated_words(ids: np.ndarray, docs: np.ndarray, n_docs: int, k: int) -> np.ndarray:
    """Per word, True where it lies in a `k`-word window that occurred earlier (suffix array over
    the word ids with a separator unique to each document after it)."""
    from pydivsufsort import divsufsort, kasai

    n = len(ids)
    if n < k or k < 1:
        return np.zeros(n, dtype=bool)
    vocab = int(ids.max()) + 1
    counts = np.bincount(docs, minlength=n_docs)
    # T: the words, document d's followed by separator vocab + d; where each word lands in T
    where = np.arange(n) + docs
    t = np.empty(n + n_docs, dtype=np.int32 if vocab + n_docs < 2**31 else np.int64)  # int32: half the memory
    t[where] = ids
    sep = np.cumsum(counts) + np.arange(n_docs)
    t[sep] = vocab + np.arange(n_docs)
    sa = divsufsort(t)
    lcp = kasai(t, sa)  # lcp[i]: common prefix of suffixes sa[i] and sa[i+1]
    # runs of suffixes sharing >= k words; in each, the smallest position is the first occurrence
    new_run = np.concatenate([[True], lcp[:-1] < k])
    starts = np.flatnonzero(new_run)
    first = np.minimum.reduceat(sa, starts)
    size = np.diff(np.concatenate([starts, [len(sa)]]))
    run_of = np.cumsum(new_run) - 1
    later = (size[run_of] > 1) & (sa != first[run_of])
    cover = np.zeros(len(t) + 1, dtype=np.int64)
    np.add.at(cover, sa[later], 1)
    np.add.at(cover, sa[later] + k, -1)
    marked = np.cumsum(cover[:-1]) > 0
    return marked[where]


def dedup_group(shards: list[str], group: list[tuple[int, int, int]], k: int, min_words: int,
                out_dir: str, index: int) -> dict:
    """Ray task: one group's documents with the repeated spans cut (see the module docstring).
    Writes one Parquet slice per (shard, rows) of the group and the drops as JSONL; returns counters."""
    t0 = time.perf_counter()
    tables = [pq.ParquetFile(shards[s]).read_row_groups(_row_groups(shards[s], a, b)) for s, a, b in group]
    tables = [_rows(t, shards[s], a, b) for t, (s, a, b) in zip(tables, group)]
    texts = [x for t in tables for x in t.column("text").to_pylist()]
    vocab: dict[str, int] = {}  # word -> dense id, this group's only
    ids = np.fromiter((vocab.setdefault(w, len(vocab)) for text in texts for w in text.split()), dtype=np.int64)
    del vocab
    counts = np.fromiter((len(text.split()) for text in texts), dtype=np.int64, count=len(texts))
    docs = np.repeat(np.arange(len(texts)), counts)
    gone = repeated_words(ids, docs, len(texts), k)
    del ids
    first_word = np.concatenate([[0], np.cumsum(counts)])
    # a cut run of words: its first word's index within the document (spans per document)
    span_start = gone & ~np.concatenate([[False], gone[:-1]]) | gone & (np.arange(len(gone)) == first_word[docs])
    spans = np.bincount(docs[span_start], minlength=len(texts))
    words_left = counts - np.bincount(docs[gone], minlength=len(texts))

    st = StepStats(STEP, docs_in=len(texts))
    removed_bytes: Counter = Counter()
    removed_spans: Counter = Counter()
    dropped_sources: Counter = Counter()
    dropped_languages: Counter = Counter()
    changed = 0
    out_paths = []
    drops = Path(out_dir) / f"drops-{index:05d}.jsonl"
    row = 0
    with open(drops, "w") as df:
        for (s, a, b), table in zip(group, tables):
            keep, new_text = [], []
            sources = table.column("source").to_pylist()
            langs = table.column("language").to_pylist()
            doc_ids = table.column("id").to_pylist()
            for j in range(table.num_rows):
                d = row + j
                text = texts[d]
                size = len(text.encode("utf-8"))
                st.bytes_in += size
                if spans[d]:
                    text = _cut(text, gone[first_word[d]:first_word[d + 1]])
                    src = sources[j] or ""
                    removed_bytes[src] += size - len(text.encode("utf-8"))
                    removed_spans[src] += int(spans[d])
                    changed += 1
                    if words_left[d] < min_words:
                        st.dropped[TOO_SHORT] += 1
                        dropped_sources[src] += 1
                        dropped_languages[str(langs[j])] += 1
                        df.write(json.dumps({"id": doc_ids[j], "step": STEP, "reason": TOO_SHORT}) + "\n")
                        continue
                keep.append(j)
                new_text.append(text)
                st.bytes_out += len(text.encode("utf-8"))
            row += table.num_rows
            kept = table.take(pa.array(keep, type=pa.int64()))
            kept = kept.set_column(kept.schema.get_field_index("text"), kept.schema.field("text"),
                                   pa.array(new_text, type=pa.string()))
            path = Path(out_dir) / f"slice-{s:05d}-{a:09d}.parquet"
            pq.write_table(kept, path)
            out_paths.append((s, a, str(path)))
            st.docs_out += len(keep)
    st.seconds = time.perf_counter() - t0
    return {"stats": st.to_dict(), "slices": out_paths, "drops": str(drops), "removed_bytes": dict(removed_bytes),
            "removed_spans": dict(removed_spans), "docs_changed": changed, "dropped_sources": dict(dropped_sources),
            "dropped_languages": dict(dropped_languages), "words": int(len(gone)), "text_bytes": st.bytes_in}


def _cut(text: str, gone: np.ndarray) -> str:
    """`text` without the words flagged in `gone` (one flag per word), each cut word taking the
    whitespace after it; trailing whitespace stripped."""
    words = list(_WORD.finditer(text))
    pieces = [text[:words[0].start()]] if words else [text]
    for i, m in enumerate(words):
        if not gone[i]:
            pieces.append(text[m.start():words[i + 1].start() if i + 1 < len(words) else len(text)])
    return "".join(pieces).rstrip()


def _row_groups(path: str, a: int, b: int) -> list[int]:
    md = pq.ParquetFile(path).metadata
    out, row = [], 0
    for g in range(md.num_row_groups):
        n = md.row_group(g).num_rows
        if row < b and row + n > a:
            out.append(g)
        row += n
    return out


def _rows(table: pa.Table, path: str, a: int, b: int) -> pa.Table:
    """Rows [a, b) of the shard from the row groups `_row_groups` read."""
    md = pq.ParquetFile(path).metadata
    first = 0
    for g in range(md.num_row_groups):
        n = md.row_group(g).num_rows
        if first + n > a:
            break
        first += n
    return table.slice(a - first, b - a)


def replace_shard(path: str, slices: list[str]) -> None:
    """Ray task: the shard, atomically, as its slices' rows in order."""
    from tasks.core.documents import DOC_SCHEMA

    p = Path(path)
    tmp = p.with_name(f".{p.name}.substring.tmp")
    with pq.ParquetWriter(tmp, pq.read_schema(path) if p.exists() else DOC_SCHEMA) as w:
        for s in slices:
            t = pq.read_table(s)
            if t.num_rows:
                w.write_table(t, row_group_size=500)
    tmp.replace(p)


@dataclass
class SubstringResult:
    """What the pass did: its step stats, the drop files (dropped.jsonl lines, in corpus order) and
    the per-source report."""
    step: StepStats
    drop_files: list[str]
    groups: int
    removed_bytes: Counter = field(default_factory=Counter)
    removed_spans: Counter = field(default_factory=Counter)
    dropped_sources: Counter = field(default_factory=Counter)
    dropped_languages: Counter = field(default_factory=Counter)
    docs_changed: int = 0
    words: int = 0
    max_group_bytes: int = 0

    def report(self, cfg: SubstringDedupConfig) -> dict:
        return {"min_tokens": cfg.min_tokens, "tokens": "whitespace words",
                "max_bytes_per_process": cfg.max_bytes_per_process, "groups": self.groups,
                "max_group_bytes": self.max_group_bytes, "words": self.words,
                "docs_changed": self.docs_changed, "docs_dropped": sum(self.step.dropped.values()),
                "bytes_removed": sum(self.removed_bytes.values()),
                "by_source": {s: {"bytes_removed": self.removed_bytes[s], "spans_removed": self.removed_spans[s],
                                  "docs_dropped": self.dropped_sources.get(s, 0)}
                              for s in sorted(self.removed_bytes)},
                "seconds": round(self.step.seconds, 3)}


def substring_dedup(shards: list[str], cfg: SubstringDedupConfig, min_words: int, work_dir: Path,
                    task_cpus: float = 1) -> SubstringResult:
    """Cut the repeated spans out of the curated `shards` in place (Ray tasks; see the module
    docstring). `task_cpus`: CPUs each task asks Ray for (how many run at once; the output is the same)."""
    import ray

    t0 = time.perf_counter()
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    for old in work_dir.glob("*"):  # a killed earlier pass's slices: this pass writes them again
        old.unlink()
    shards = [str(s) for s in shards]
    remote = ray.remote(num_cpus=task_cpus)
    groups = ray.get(remote(plan_groups).remote(shards, cfg.max_bytes_per_process))
    got = ray.get([remote(dedup_group).remote(shards, g, cfg.min_tokens, min_words, str(work_dir), i)
                   for i, g in enumerate(groups)])
    slices: dict[int, list[tuple[int, str]]] = {}
    res = SubstringResult(StepStats(STEP), [g["drops"] for g in got], len(groups))
    for g in got:
        res.step.merge(StepStats.from_dict(g["stats"]))
        res.removed_bytes.update(g["removed_bytes"])
        res.removed_spans.update(g["removed_spans"])
        res.dropped_sources.update(g["dropped_sources"])
        res.dropped_languages.update(g["dropped_languages"])
        res.docs_changed += g["docs_changed"]
        res.words += g["words"]
        res.max_group_bytes = max(res.max_group_bytes, g["text_bytes"])
        for s, a, p in g["slices"]:
            slices.setdefault(s, []).append((a, p))
    ray.get([remote(replace_shard).remote(shards[s], [p for _, p in sorted(v)]) for s, v in slices.items()])
    res.step.seconds = time.perf_counter() - t0
    return res


def apply_to_curated(cfg, written, steps: list[StepStats], work_dir: Path) -> SubstringResult:
    """Curate's hook (`tasks.curate.run`), after the curated shards and dropped.jsonl are written:
    the pass over `written.shards`, its drops appended to `written.dropped_file`, its step to
    `steps` (the accounting), and `written`'s counters and dedup report updated."""
    from tasks.dedup.stages import concat_files

    sub = cfg.curate.dedup.substring
    gq = cfg.curate.gopher_quality
    # a shortened document must still pass the Gopher minimum; without that filter, an emptied one goes
    res = substring_dedup(written.shards, sub, gq.min_doc_words if gq.enabled else 1, work_dir)
    concat_files([written.dropped_file, *res.drop_files], written.dropped_file)
    steps.append(res.step)
    written.docs_out -= sum(res.step.dropped.values())
    written.bytes_out -= res.step.bytes_in - res.step.bytes_out
    written.sources_out = +(written.sources_out - res.dropped_sources)  # (+: without the emptied keys)
    written.languages_out = +(written.languages_out - res.dropped_languages)
    written.dedup["substring"] = res.report(sub)
    return res
