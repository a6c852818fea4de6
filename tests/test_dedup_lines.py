"""Line dedup across the corpus (tasks.dedup.lines) on real docs-crawl pages: CCNet's line
normalisation, and the Sphinx navigation repeated over the kernel docs' index pages removed while
each page's own text stays. The Ray counting (spilled, partitioned) is checked against the
in-process one in tests/test_curate.py, which has a Ray session."""
from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest

from tasks.config import DATA_ROOT_ENV, DEFAULT_DATA_ROOT, IngestConfig, LineDedupConfig, SourceConfig
from tasks.core.documents import write_docs
from tasks.dedup.lines import LineDedupFilter, count_frequent_lines, normalise_line
from tasks.ingest.process import process_file_range
from text_helpers import assert_same_on_every_code_point

DATA = Path(os.environ.get(DATA_ROOT_ENV) or DEFAULT_DATA_ROOT)
WARC = DATA / "web" / "docs-crawl-00000.warc.gz"
pytestmark = pytest.mark.skipif(not WARC.exists(), reason=f"no data under {DATA}")

MAX_DOCS = 3
# the kernel docs' sidebar, kept by trafilatura in recall mode on the index pages
NAVIGATION = ["Core API Documentation", "Kernel subsystem documentation", "Code of conduct", "View page source"]


def test_normalise_line_is_ccnets():
    assert normalise_line("  Ünïcode Café — 2023 Edition!  ") == "unicode cafe 0000 edition"
    assert normalise_line("Page 12 of 345 »") == normalise_line("page 99 of 100")
    assert normalise_line("|---|---|") == "" and normalise_line("   ") == ""
    # the translate table gives what CCNet's regex substitutions give, on every code point from
    # U+0020 to U+10FFFF (surrogates and unassigned ones included), one string per 64 Ki block
    import unicodedata

    import regex

    def reference(text: str) -> str:
        s = unicodedata.normalize("NFD", " ".join(text.lower().split()))
        s = regex.sub(r"[\p{Mn}\p{P}\p{S}\p{Cc}\p{Cf}]+", "", regex.sub(r"\d", "0", s))
        return " ".join(s.split())

    mixed = " \tA\u00e9\u0301b 1,5%\u20ac x\u0660y\u200b"
    assert normalise_line(mixed) == reference(mixed) == "aeb 00 x0y"
    assert_same_on_every_code_point(normalise_line, reference)
    assert normalise_line("Home\tabout\u00a0 us") == "home about us"


@pytest.fixture(scope="module")
def pages() -> list[dict]:
    """~100 docs-crawl pages (kernel, handbook, Python docs), extracted by trafilatura in recall
    mode so the kernel index pages keep their navigation sidebar (resiliparse's main content and
    trafilatura's precision mode drop it at extraction already)."""
    src = SourceConfig(name="docs-crawl", uri=str(WARC), format="warc", licence="test", provenance="shared/data")
    ingest = IngestConfig(extractor="trafilatura", favour_precision=False)
    docs = []
    for start, stop in ((0, 60), (105, 115), (160, 195)):
        docs += process_file_range(src, str(WARC), ingest, start, stop)["docs"]
    return docs


@pytest.fixture(scope="module")
def shards(pages, tmp_path_factory) -> list[Path]:
    return write_docs(pages, tmp_path_factory.mktemp("lines") / "in", shard_docs=40)


def _recount(texts: list[str]) -> Counter:
    """Distinct documents (identical texts once) per normalised line, counted here independently."""
    c: Counter = Counter()
    for text in set(texts):
        c.update({n for n in map(normalise_line, text.split("\n")) if n})
    return c


def test_navigation_removed_article_text_kept(pages, shards, tmp_path):
    frequent = count_frequent_lines(shards, LineDedupConfig(max_docs=MAX_DOCS), tmp_path, method="local")
    counts = _recount([d["text"] for d in pages])
    assert frequent.stats["frequent_lines"] == sum(1 for n in counts.values() if n > MAX_DOCS) > 0
    nav_pages = [d for d in pages if "Core API Documentation" in d["text"].split("\n")]
    assert len(nav_pages) > MAX_DOCS
    step = LineDedupFilter(frequent.hashes, min_words=50)
    out = {}
    for d in pages:
        doc = dict(d)
        if step.decide(doc) is None:
            out[d["id"]] = doc["text"]
    removed = step.drain()["docs-crawl"]
    assert removed["docs_shortened"] >= len(nav_pages) and removed["lines_removed"] > 0
    for d in pages:
        if d["id"] not in out:
            continue
        lines = set(out[d["id"]].split("\n"))
        for line in d["text"].split("\n"):
            norm = normalise_line(line)
            if norm and counts[norm] <= MAX_DOCS:
                assert line in lines, (d["url"], line)  # the page's own text stays
            elif norm:
                assert line not in lines, (d["url"], line)
    kept_nav = [d for d in nav_pages if d["id"] in out]
    assert kept_nav, "every index page was dropped"
    for d in kept_nav:
        assert not set(NAVIGATION) & set(out[d["id"]].split("\n"))
        assert len(out[d["id"]]) < len(d["text"])
    caif = next(d for d in kept_nav if "/networking/caif/" in d["url"])
    assert "Preparing the setup with a STE modem" in out[caif["id"]]



def test_spill_tasks_and_partitions_follow_the_text_bytes(shards):
    """On Ray, long documents (books) bound a spill task by its text bytes and size the partitions
    too, not only the document count."""
    from tasks.dedup.lines import _chunks, default_partitions

    import pyarrow.parquet as pq

    row_groups = sum(pq.ParquetFile(s).metadata.num_row_groups for s in shards)
    chunks, n_docs, text_bytes = _chunks([str(s) for s in shards])
    assert len(chunks) == 1 < row_groups and n_docs == 105 and text_bytes > 0
    by_bytes, _, _ = _chunks([str(s) for s in shards], task_bytes=1)
    assert len(by_bytes) == row_groups  # every row group over the byte budget: a task each
    assert default_partitions(1_000) == 2 and default_partitions(1_000, 10 * 2**30) > 2
