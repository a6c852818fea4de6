"""HTML → text with trafilatura or resiliparse (`ingest.extractor`), plus the charset decoding
in front of either.

Decoding: the charset comes from the HTTP Content-Type, else from a `<meta charset>` in the
first 4 KiB, else UTF-8. Decoding is strict: bytes that are not valid in that charset raise
`DecodeFailed` and the ingest step quarantines the record ("invalid_utf8" for UTF-8,
"decode_error" otherwise) instead of guessing.

Extraction: `trafilatura.bare_extraction` with `favor_precision` from the config, no comments,
tables kept, no cross-document deduplication (it is stateful and would make output depend on
which worker saw which page first). With `extract_metadata` the title and page date come from
trafilatura's metadata (date search not extensive, original date preferred); without it the
title is the page's `<title>` and there is no page date. Either way the caller falls back to
the crawl date.

Resiliparse (`extractor: resiliparse`): the page is parsed once into a Lexbor DOM;
`extract_plain_text` with `main_content=True` keeps block structure (one line per paragraph,
which the line-based filters and line dedup rely on) and list bullets, and leaves out image alt
texts, link targets, form fields, `<noscript>`, comment sections and post meta (bylines), the
counterparts of what the trafilatura call above leaves out. The title is the page's `<title>`.
With `extract_metadata` the page date comes from htmldate with the same settings trafilatura
uses (it is trafilatura's own date finder), so `date` means the same thing whichever extractor ran.
A page nested deeper than `MAX_NESTING` elements is refused (`HTMLTooDeep`, quarantined as
"extraction_error"): Resiliparse's main-content pass is superlinear in depth.
Decoding is the shared strict path above for both, so a page is quarantined or dropped for the
same reasons whichever extractor is configured.
"""
from __future__ import annotations

import codecs
import html as html_lib
import logging
import re

HTML_MEDIA_TYPES = frozenset({"text/html", "application/xhtml+xml"})
_META_CHARSET = re.compile(rb"""<meta[^>]{0,200}?charset\s*=\s*["']?\s*([A-Za-z0-9_\-:.]+)""", re.I)
# The <title> finder runs in linear time: a literal start tag, the next ">", then the first end tag. (One
# regex `<title[^>]*>(.*?)</title\s*>` retried its lazy scan from every "<title" of an unclosed title:
# quadratic, 28 s of CPU for one hostile 80 k-character title.)
_TITLE_OPEN = re.compile(r"<title", re.I)
_TITLE_CLOSE = re.compile(r"</title\s*>", re.I)
_TITLE_SCAN = 200_000  # characters of a page searched for its title
# Resiliparse's main-content pass takes time superlinear in nesting depth (20,000 nested <div>s:
# over 10 s, 200,000: minutes), so deeper pages are refused (quarantined "extraction_error").
# 512 is where Chromium's HTML parser stops nesting; real pages stay far below (docs crawl: 20)
MAX_NESTING = 512
_TAG_OPEN_CLOSE = re.compile(r"<([A-Za-z][A-Za-z0-9]*)|</([A-Za-z][A-Za-z0-9]*)")
# void elements and elements whose end tag may be left out: they do not deepen the tree
_FLAT_TAGS = frozenset("area base br col embed hr img input link meta param source track wbr p li td th tr "
                       "dt dd option optgroup thead tbody tfoot colgroup rt rp".split())
# htmldate settings for both extractors: no extensive (slow, guessy) search, publication date
_DATE_SEARCH = {"extensive_search": False, "original_date": True}

logging.getLogger("trafilatura").setLevel(logging.ERROR)
logging.getLogger("htmldate").setLevel(logging.ERROR)


class HTMLTooDeep(ValueError):
    pass


class DecodeFailed(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def media_type(content_type: str | None) -> str:
    return (content_type or "").split(";", 1)[0].strip().lower()


def declared_charset(content_type: str | None) -> str | None:
    for part in (content_type or "").split(";")[1:]:
        key, _, value = part.partition("=")
        if key.strip().lower() == "charset" and value.strip():
            return value.strip().strip("\"'").lower()
    return None


def decode_html(payload: bytes, content_type: str | None) -> str:
    charset = declared_charset(content_type)
    if charset is None:
        m = _META_CHARSET.search(payload[:4096])
        charset = m.group(1).decode("ascii", "replace").lower() if m else "utf-8"
    try:
        codec = codecs.lookup(charset).name
    except LookupError:
        codec = "utf-8"
    try:
        return payload.decode(codec)
    except UnicodeDecodeError as e:
        reason = "invalid_utf8" if codec == "utf-8" else "decode_error"
        raise DecodeFailed(reason, f"{codec}: {e}"[:300]) from None


def _title_tag(html: str) -> str | None:
    """The first <title> element's text in the page's first `_TITLE_SCAN` characters (whitespace
    collapsed, entities resolved), or None."""
    head = html[:_TITLE_SCAN]
    opened = _TITLE_OPEN.search(head)
    if not opened:
        return None
    start = head.find(">", opened.end())
    # no match for the first "<title" means none for a later one: its ">" and end tag would come later still
    closed = _TITLE_CLOSE.search(head, start + 1) if start >= 0 else None
    if not closed:
        return None
    title = " ".join(html_lib.unescape(head[start + 1:closed.start()]).split())
    return title or None


def extract_html(html: str, url: str | None, favour_precision: bool = True,
                 with_metadata: bool = True, extractor: str = "trafilatura"
                 ) -> tuple[str | None, str | None, str | None]:
    """Return (text, title, page date); text is None when nothing could be extracted."""
    if extractor == "resiliparse":
        return _extract_resiliparse(html, url, with_metadata)
    if extractor != "trafilatura":
        raise ValueError(f"unknown extractor {extractor!r}")
    import trafilatura

    result = trafilatura.bare_extraction(
        html, url=url, favor_precision=favour_precision, include_comments=False,
        include_tables=True, deduplicate=False, with_metadata=with_metadata,
        date_extraction_params=dict(_DATE_SEARCH),
    )
    if result is None:
        return None, _title_tag(html), None
    text = getattr(result, "text", None)
    if with_metadata:
        title = getattr(result, "title", None) or _title_tag(html)
        date = getattr(result, "date", None)
    else:
        title, date = _title_tag(html), None
    return text, title, date


def _extract_resiliparse(html: str, url: str | None, with_metadata: bool
                         ) -> tuple[str | None, str | None, str | None]:
    from resiliparse.extract.html2text import extract_plain_text
    from resiliparse.parse.html import HTMLTree

    if html.count("<") > MAX_NESTING and (depth := nesting_depth(html)) > MAX_NESTING:
        raise HTMLTooDeep(f"elements nested {depth} deep > {MAX_NESTING}")
    tree = HTMLTree.parse(html)
    text = extract_plain_text(
        tree, preserve_formatting=True, main_content=True, list_bullets=True, alt_texts=False,
        links=False, form_fields=False, noscript=False, comments=False, post_meta=False,
    )
    title = " ".join((tree.title or "").split()) or None
    date = None
    if with_metadata:
        from htmldate import find_date

        date = find_date(html, url=url, **_DATE_SEARCH)
    return text or None, title, date


def nesting_depth(html: str) -> int:
    """Upper estimate of the element nesting depth from the tags alone (no parse): open tags
    minus close tags, not counting void elements and those with optional end tags."""
    depth = deepest = 0
    for opened, closed in _TAG_OPEN_CLOSE.findall(html):
        if opened:
            if opened.lower() not in _FLAT_TAGS:
                depth += 1
                deepest = max(deepest, depth)
        elif closed.lower() not in _FLAT_TAGS:
            depth = max(depth - 1, 0)
    return deepest
