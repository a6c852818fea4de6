"""HTML → text with trafilatura, plus the charset decoding in front of it.

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
"""
from __future__ import annotations

import codecs
import html as html_lib
import logging
import re

HTML_MEDIA_TYPES = frozenset({"text/html", "application/xhtml+xml"})
_META_CHARSET = re.compile(rb"""<meta[^>]{0,200}?charset\s*=\s*["']?\s*([A-Za-z0-9_\-:.]+)""", re.I)
_TITLE = re.compile(r"<title[^>]*>(.*?)</title\s*>", re.I | re.S)

logging.getLogger("trafilatura").setLevel(logging.ERROR)
logging.getLogger("htmldate").setLevel(logging.ERROR)


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
    m = _TITLE.search(html, 0, 200_000)
    if not m:
        return None
    title = " ".join(html_lib.unescape(m.group(1)).split())
    return title or None


def extract_html(html: str, url: str | None, favour_precision: bool = True,
                 with_metadata: bool = True) -> tuple[str | None, str | None, str | None]:
    """Return (text, title, page date); text is None when nothing could be extracted."""
    import trafilatura

    result = trafilatura.bare_extraction(
        html, url=url, favor_precision=favour_precision, include_comments=False,
        include_tables=True, deduplicate=False, with_metadata=with_metadata,
        date_extraction_params={"extensive_search": False, "original_date": True},
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
