"""URL dedup: documents with the same normalised URL keep one copy (a page crawled twice).

Normalisation (`normalise_url`): scheme and host lower-cased; the default port (:80 for http,
:443 for https) dropped; the fragment dropped; tracking query parameters dropped
(`dedup.url.tracking_params`: utm_*, fbclid, gclid, ...; case-insensitive, a trailing * is a
prefix); the remaining parameters sorted by name then value (a reordered query is the same
page far more often than the order matters); an empty path made "/". The path, the
parameters' values and the case of the path are kept as they are. A URL that `urlsplit`
cannot parse is compared as its stripped text.

Keep rule (`url_duplicates`): the newest crawl date; among equal (or unknown) dates the longest
text (UTF-8 bytes); then the first in corpus order, so the outcome does not depend on
parallelism. A document without a URL is not URL-deduplicated. A crawl date that
`parse_crawl_date` cannot read counts as older than any known one.
"""
from __future__ import annotations

import hashlib
from datetime import datetime, timezone
from typing import Sequence
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

_DEFAULT_PORTS = {"http": 80, "https": 443}


class TrackingParams:
    """Matches query parameter names against `dedup.url.tracking_params`."""

    def __init__(self, patterns: Sequence[str]):
        pats = [p.lower() for p in patterns]
        self.exact = frozenset(p for p in pats if not p.endswith("*"))
        self.prefixes = tuple(p[:-1] for p in pats if p.endswith("*"))

    def __call__(self, name: str) -> bool:
        name = name.lower()
        return name in self.exact or (bool(self.prefixes) and name.startswith(self.prefixes))


def normalise_url(url: str, tracking: TrackingParams) -> str:
    """The URL under which copies of a page compare equal (see the module docstring)."""
    url = url.strip()
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:  # e.g. a port that is not a number
        return url
    scheme = parts.scheme.lower()
    host = (parts.hostname or "").rstrip(".")
    if ":" in host:  # IPv6 literal: urlsplit strips the brackets
        host = f"[{host}]"
    netloc = host if port is None or port == _DEFAULT_PORTS.get(scheme) else f"{host}:{port}"
    if parts.username is not None:  # keep user info as given
        userinfo = parts.netloc.rpartition("@")[0]
        netloc = f"{userinfo}@{netloc}"
    query = sorted((k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if not tracking(k))
    path = parts.path or ("/" if netloc else "")
    return urlunsplit((scheme, netloc, path, urlencode(query), ""))


def url_key(url: str | None, tracking: TrackingParams) -> bytes | None:
    """16 bytes identifying the normalised URL (what the curate driver holds per document), or
    None for a document without a URL."""
    if not url or not url.strip():
        return None
    return hashlib.blake2b(normalise_url(url, tracking).encode("utf-8"), digest_size=16).digest()


def parse_crawl_date(value: str | None) -> float | None:
    """POSIX seconds of an ISO 8601 crawl date (WARC-Date, "2019-07-17T12:15:59.000Z"); a date
    without a zone is taken as UTC; None when absent or unreadable."""
    if not value:
        return None
    try:
        dt = datetime.fromisoformat(value.strip())
    except ValueError:
        return None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.timestamp()


def url_duplicates(keys: Sequence[bytes | None], crawl_times: Sequence[float | None],
                   nbytes: Sequence[int]) -> list[int | None]:
    """Per document (in corpus order) the position of the copy kept for its URL if it is another
    one, else None. Keep rule: newest crawl time, then longest text, then first position."""
    best: dict[bytes, int] = {}

    def rank(i: int) -> tuple:
        t = crawl_times[i]
        return (t is not None, t if t is not None else 0.0, nbytes[i], -i)

    for i, k in enumerate(keys):
        if k is not None and (k not in best or rank(i) > rank(best[k])):
            best[k] = i
    return [None if k is None or best[k] == i else best[k] for i, k in enumerate(keys)]
