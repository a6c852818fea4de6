"""Exact-substring dedup (tasks.dedup.substring): on real prose paragraphs with planted repeats, a
60-word span is cut from every document but the first, a 40-word one stays at min_tokens 50, the
bytes are counted per source, a document left too short is dropped with its reason, the bound on
bytes per task holds, and in `run_curate` the step is accounted for (and absent when off)."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tasks.config import DATA_ROOT_ENV, DEFAULT_DATA_ROOT, PipelineConfig, RayConfig, SourceConfig, \
    SubstringDedupConfig
from tasks.core.documents import iter_docs, make_doc_id, write_docs
from tasks.dedup.substring import TOO_SHORT, substring_dedup

DATA = Path(os.environ.get(DATA_ROOT_ENV) or DEFAULT_DATA_ROOT)
BOOK = DATA / "text" / "gutenberg" / "austen-persuasion.txt"
pytestmark = pytest.mark.skipif(not BOOK.exists(), reason=f"no data under {DATA}")


def _paragraphs(n: int, min_words: int = 80) -> list[str]:
    """The first `n` paragraphs (lines) of at least `min_words` words of a real novel, the
    tokenised file's spaces before punctuation removed, with few punctuation marks (so that the
    Gopher filter, which counts them as words without a letter, keeps every one)."""
    out = []
    for para in BOOK.read_text(encoding="utf-8").splitlines():
        words = re.sub(r" ([,.;:!?])", r"\1", para).split()
        if len(words) >= min_words and len(re.findall(r"[^\w\s]", para)) < 0.15 * len(words):
            out.append(" ".join(words))
        if len(out) == n:
            return out
    raise AssertionError(f"{BOOK} has fewer than {n} long paragraphs")


def _words(text: str, a: int, b: int) -> str:
    return " ".join(text.split()[a:b])


def _corpus() -> tuple[list[dict], str, str]:
    """24 documents from two sources; a 60-word span (from a paragraph not otherwise used) planted
    mid-text in documents 2, 9 and 17, a 40-word span in 4 and 12, and document 20 mostly the span."""
    paras = _paragraphs(26)
    span60, span40 = _words(paras[24], 0, 60), _words(paras[25], 0, 40)
    texts = paras[:24]
    for i in (2, 9, 17):
        texts[i] = f"{_words(texts[i], 0, 30)} {span60} {_words(texts[i], 30, 10_000)}"
    for i in (4, 12):
        texts[i] = f"{_words(texts[i], 0, 20)} {span40} {_words(texts[i], 20, 10_000)}"
    texts[20] = f"{_words(texts[20], 0, 20)} {span60}"  # 20 words left: below the Gopher 50
    docs = [{"id": make_doc_id("src-a" if i % 2 else "src-b", str(i)), "text": t,
             "source": "src-a" if i % 2 else "src-b", "language": "en"} for i, t in enumerate(texts)]
    return docs, span60, span40


def _run(tmp: Path, name: str, docs: list[dict], **kw):
    shards = [str(p) for p in write_docs(docs, tmp / name, shard_docs=10)]
    task_cpus = kw.pop("task_cpus", 1)
    res = substring_dedup(shards, SubstringDedupConfig(enabled=True, **kw), 50, tmp / f"{name}-work", task_cpus)
    return res, list(iter_docs(shards))


def test_planted_spans_cut_counted_and_short_documents_dropped(ray_session, tmp_path):
    docs, span60, span40 = _corpus()
    res, out = _run(tmp_path, "big", docs)
    texts = {d["id"]: d["text"] for d in out}
    ids = [d["id"] for d in docs]
    assert res.groups == 1  # the whole corpus under the bound: exact
    assert span60 in texts[ids[2]]  # the first occurrence stays
    for i in (9, 17):  # later ones are cut, with the whitespace after them: the rest is the original
        assert span60 not in texts[ids[i]]
        assert texts[ids[i]] == f"{_words(docs[i]['text'], 0, 30)} {_words(docs[i]['text'], 90, 10_000)}"
    assert ids[20] not in texts  # 20 words left: dropped
    assert all(span40 in texts[ids[i]] for i in (4, 12))  # 40 < min_tokens 50: kept
    unchanged = [i for i in range(24) if i not in (9, 17, 20)]
    assert all(texts[ids[i]] == docs[i]["text"] for i in unchanged)
    # bytes per source: 9 and 17 (src-a) lose the span and one space, 20 (src-b) the span and the space before it
    cut = len(span60.encode()) + 1
    assert res.removed_bytes == {"src-a": 2 * cut, "src-b": cut}
    assert res.removed_spans == {"src-a": 2, "src-b": 1}
    assert res.step.docs_in == 24 and res.step.docs_out == 23 and res.step.dropped == {TOO_SHORT: 1}
    assert res.step.bytes_in - res.step.bytes_out == 2 * cut + len(docs[20]["text"].encode())  # 20 is gone whole
    drops = [json.loads(line) for f in res.drop_files for line in Path(f).read_text().splitlines()]
    assert drops == [{"id": ids[20], "step": "substring_dedup", "reason": TOO_SHORT}]
    assert res.report(SubstringDedupConfig())["by_source"]["src-b"] == {"bytes_removed": cut, "spans_removed": 1,
                                                                     "docs_dropped": 1}

    # at min_tokens 40 the 40-word span goes too
    res40, out40 = _run(tmp_path, "k40", docs, min_tokens=40)
    t40 = {d["id"]: d["text"] for d in out40}
    assert span40 in t40[ids[4]] and span40 not in t40[ids[12]]


def test_bytes_per_process_bound_and_same_output_whatever_the_workers(ray_session, tmp_path):
    docs, span60, _ = _corpus()
    total = sum(len(d["text"].encode()) for d in docs)
    bound = total // 5
    res, out = _run(tmp_path, "small", docs, max_bytes_per_process=bound)
    assert res.groups >= 5 and res.max_group_bytes <= bound  # more groups, none over the bound
    # one task at a time (each asks for both CPUs) gives the same shards, byte for byte
    res1, out1 = _run(tmp_path, "serial", docs, max_bytes_per_process=bound, task_cpus=2)
    assert out1 == out and res1.removed_bytes == res.removed_bytes
    # the documented limit: a repeat is found within a group only
    big, _ = _run(tmp_path, "big", docs)
    assert sum(res.removed_bytes.values()) < sum(big.removed_bytes.values())


def _curate_cfg(enabled: bool) -> PipelineConfig:
    # only the Gopher quality filter on (the minimum the pass re-checks); the rest would only slow the test
    return PipelineConfig.model_validate({
        "name": "substring-test", "data_root": str(DATA), "ray": RayConfig(num_cpus=2).model_dump(),
        "sources": [SourceConfig(name="src-a", uri="x", format="jsonl", licence="test", provenance="test").model_dump()],
        "curate": {"langid": {"enabled": False}, "gopher_repetition": {"enabled": False}, "c4": {"enabled": False},
                   "fineweb": {"enabled": False}, "decontam": {"enabled": False},
                   "dedup": {"lines": {"enabled": False}, "substring": {"enabled": enabled}}}})


def test_run_curate_accounts_for_the_step_and_off_changes_nothing(ray_session, tmp_path):
    from tasks.curate import run_curate

    docs, span60, _ = _corpus()
    shards = write_docs(docs, tmp_path / "in", shard_docs=10)
    off = run_curate(_curate_cfg(False), shards, tmp_path / "off")
    on = run_curate(_curate_cfg(True), shards, tmp_path / "on")
    assert "substring_dedup" not in [s["name"] for s in off["steps"]] and "substring" not in off["dedup"]
    kept_off = {d["id"]: d["text"] for d in iter_docs(off["shards"])}
    assert off["docs_out"] == 24, off["dropped"]
    assert sum(span60 in t for t in kept_off.values()) == 4

    assert on["steps"][-1]["name"] == "substring_dedup"
    assert on["docs_out"] == 23 and on["dropped"][TOO_SHORT] == 1
    assert on["docs_out"] + sum(on["dropped"].values()) == on["docs_in"] == 24
    assert sum(span60 in d["text"] for d in iter_docs(on["shards"])) == 1
    assert sum(pq.read_metadata(s).num_rows for s in on["shards"]) == 23
    assert on["sources"]["src-b"]["docs_out"] == off["sources"]["src-b"]["docs_out"] - 1
    cut = len(span60.encode()) + 1
    assert on["dedup"]["substring"]["by_source"]["src-a"]["bytes_removed"] == 2 * cut
    assert on["bytes_out"] < off["bytes_out"]
    lines = [json.loads(x) for x in Path(on["dropped_file"]).read_text().splitlines()]
    assert [x["reason"] for x in lines] == [TOO_SHORT]
    # the stage's report table (Prefect artifact) per source; none without the step
    from tasks.curate.stage import curation_reports

    table = {r.key: r for r in curation_reports(on)}["substring-dedup-by-source"]
    assert {row["source"]: row["bytes_removed"] for row in table.rows} == {"src-a": 2 * cut, "src-b": cut}
    assert "substring-dedup-by-source" not in {r.key for r in curation_reports(off)}
