"""HTML extractors (`ingest.extractor`): resiliparse on a real docs-crawl page keeps the article
and leaves the site navigation out, the config switch changes what ingest produces, and bad HTML
is dropped or quarantined with reasons whichever extractor runs."""
from __future__ import annotations

import pydantic
import pytest
from test_ingest import WEB, html_page, needs_data, src, warc_response

from tasks.config import IngestConfig
from tasks.ingest.extract import MAX_NESTING
from tasks.ingest.process import process_file_range
from tasks.ingest.readers import RawRecord, iter_records

DOCS_CRAWL = WEB / "docs-crawl-00000.warc.gz"
KERNEL_PAGE = 5  # candidate index of admin-guide/hw_random.html in docs-crawl-00000
NAVIGATION = ("Search docs", "View page source", "Built with", "Submitting patches", "Core API Documentation")


def _kernel_page_doc(extractor: str) -> dict:
    source = src("docs-crawl", DOCS_CRAWL, "warc")
    res = process_file_range(source, str(DOCS_CRAWL), IngestConfig(extractor=extractor), KERNEL_PAGE, KERNEL_PAGE + 1)
    [doc] = res["docs"]
    assert doc["url"].endswith("/admin-guide/hw_random.html")
    return doc


@needs_data
def test_resiliparse_keeps_article_and_drops_navigation():
    raw = [r for r in iter_records(DOCS_CRAWL, "warc") if isinstance(r, RawRecord)][KERNEL_PAGE].payload.decode()
    text = _kernel_page_doc("resiliparse")["text"]
    for sentence in ("The hw_random framework is software that makes use of a special hardware feature",
                     "Special thanks to Matt Sottek."):
        assert sentence in text
    for nav in NAVIGATION:  # the theme's sidebar, breadcrumbs and footer are in the page...
        assert nav in raw
        assert nav not in text  # ...but not in the extracted main content


@needs_data
def test_extractor_switch_changes_the_output():
    resiliparse, trafilatura = _kernel_page_doc("resiliparse"), _kernel_page_doc("trafilatura")
    assert resiliparse["text"] != trafilatura["text"]
    assert resiliparse["title"] != trafilatura["title"]  # <title> vs trafilatura's metadata title
    assert set(resiliparse) == set(trafilatura)  # one document schema whichever extractor ran
    with pytest.raises(pydantic.ValidationError):
        IngestConfig(extractor="beautifulsoup")


@pytest.mark.parametrize("extractor", ["resiliparse", "trafilatura"])
def test_bad_html_dropped_or_quarantined_with_reasons(extractor, tmp_path):
    pages = [
        warc_response("https://site.test/good", html_page("Good")),
        warc_response("https://site.test/empty", b"<html><body></body></html>"),
        warc_response("https://site.test/script", b"<html><body><script>var a = 1;</script></body></html>"),
        warc_response("https://site.test/bad-utf8", html_page("Bad") + b"\xff\xfe broken"),
        warc_response("https://site.test/deep", b"<div>" * (MAX_NESTING + 100) + html_page("Deep", 2)),
    ]
    path = tmp_path / "bad.warc.gz"
    path.write_bytes(b"".join(pages))
    res = process_file_range(src("bad", path, "warc"), str(path), IngestConfig(extractor=extractor))
    assert res["docs_in"] == 5
    assert res["docs_in"] == res["docs_out"] + sum(res["dropped"].values()) + sum(res["quarantined"].values())
    assert res["dropped"]["empty_extraction"] >= 2 and res["quarantined"]["invalid_utf8"] == 1
    assert "https://site.test/good" in [d["url"] for d in res["docs"]]
    if extractor == "resiliparse":  # nesting that would take resiliparse minutes is refused
        assert res["quarantined"] == {"invalid_utf8": 1, "extraction_error": 1}
        deep = next(q for q in res["quarantine"] if q["reason"] == "extraction_error")
        assert deep["url"] == "https://site.test/deep" and "HTMLTooDeep" in deep["detail"]
        assert res["docs_out"] == 1 and res["dropped"] == {"empty_extraction": 2}


def _within(seconds: int, fn, *args):
    """`fn(*args)`, or TimeoutError after `seconds` (a guard against a hang, not a benchmark)."""
    import signal

    def expired(signum, frame):
        raise TimeoutError(f"{fn.__name__} ran over {seconds} s: super-linear")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        return fn(*args)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_title_tag_is_found_in_linear_time_on_hostile_pages():
    """The <title> finder (the fallback of both extractors' titles) on 200,000-character pages built to make
    a backtracking regex quadratic: an unclosed title full of "<title>" openings, "<title" with no ">",
    and "</title" without its ">" before the real end tag. Each answers correctly well within the guard."""
    from tasks.ingest.extract import _title_tag

    n = 190_000  # the finder looks at a page's first 200,000 characters
    assert _within(10, _title_tag, "<html><head><title>" + "<title>x" * (200_000 // 8)) is None
    assert _within(10, _title_tag, "<TITLE" * (200_000 // 6)) is None
    nested = "<title>A " + "<title>b " * (n // 9) + "</title >"
    assert _within(10, _title_tag, nested) == "A " + "<title>b " * (n // 9 - 1) + "<title>b"
    near_misses = "<html><head><Title lang=en>Real &amp; long" + "</title" * (n // 7) + "</TITLE\n></head>"
    assert _within(10, _title_tag, near_misses) == "Real & long" + "</title" * (n // 7)
    assert _title_tag("<html><head><title>  Two\n words </title></head></html>") == "Two words"
    assert _title_tag("<title>beyond the scanned prefix" + " " * 200_000 + "</title>") is None
