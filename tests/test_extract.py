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
