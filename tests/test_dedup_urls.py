"""URL dedup (tasks.dedup.urls): the normalisation, the keep rule and the dedup step's accounting.
The curate run that drops real re-crawls as "url_dedup" is in tests/test_curate.py."""
from __future__ import annotations

from tasks.config import UrlDedupConfig
from tasks.dedup.steps import DedupPass
from tasks.dedup.urls import TrackingParams, normalise_url, parse_crawl_date, url_duplicates, url_key

TRACKING = TrackingParams(UrlDedupConfig().tracking_params)


def test_normalise_url():
    n = lambda u: normalise_url(u, TRACKING)  # noqa: E731
    assert n("HTTP://Example.COM:80/Path/Page?utm_source=x&b=2&a=1#section") == "http://example.com/Path/Page?a=1&b=2"
    assert n("https://example.com:443") == "https://example.com/"
    assert n("https://example.com:80/") == "https://example.com:80/"  # not https's default port
    assert n("http://example.com:8080/x") == "http://example.com:8080/x"
    assert n("https://a.org/p?UTM_Medium=m&fbclid=1&gclid=2&id=7&q=") == "https://a.org/p?id=7&q="
    assert n("https://a.org/p?b=2&a=1") == n("https://a.org/p?a=1&b=2")
    assert n("https://a.org/p?a=1") != n("https://a.org/p?a=2")
    assert n("https://a.org/P") != n("https://a.org/p")  # paths are case sensitive
    assert n("http://a.org/") != n("https://a.org/")  # schemes stay apart
    assert n("http://[2001:DB8::1]:80/x") == "http://[2001:db8::1]/x"
    assert n("  http://a.org:notaport/x  ") == "http://a.org:notaport/x"  # unparseable: compared as text
    assert url_key(None, TRACKING) is None and url_key("  ", TRACKING) is None
    assert url_key("HTTPS://A.org/#top", TRACKING) == url_key("https://a.org/", TRACKING)
    only_utm = TrackingParams(["utm_*"])
    assert normalise_url("https://a.org/?fbclid=1&utm_x=2", only_utm) == "https://a.org/?fbclid=1"


def test_parse_crawl_date():
    assert parse_crawl_date("2019-07-17T12:15:59.000Z") == parse_crawl_date("2019-07-17T12:15:59Z")
    assert parse_crawl_date("2019-07-17T12:15:59") == parse_crawl_date("2019-07-17T14:15:59+02:00")
    assert parse_crawl_date("yesterday") is None and parse_crawl_date(None) is None


def test_keep_rule_newest_then_longest_then_first():
    a, b, c = b"a" * 16, b"b" * 16, b"c" * 16
    keys = [a, a, a, None, b, b, b, None, c, c]
    times = [1.0, 3.0, 2.0, 9.0, None, 5.0, 5.0, None, None, None]
    nbytes = [10, 10, 99, 10, 99, 10, 20, 10, 7, 7]
    assert url_duplicates(keys, times, nbytes) == [1, None, 1, None, 6, 6, None, None, None, 8]


def test_url_step_accounting():
    tracking = TrackingParams(UrlDedupConfig().tracking_params)
    urls = ["https://a.org/x?utm_source=feed", "https://A.org/x", None, "https://b.org/", "https://b.org/#c"]
    dates = ["2024-01-01T00:00:00Z", "2024-02-01T00:00:00Z", None, None, None]
    nbytes = [100, 50, 10, 30, 40]
    dedup = DedupPass(nbytes, ["d0", "d1", "d2", "d3", "d4"])
    st = dedup.url([url_key(u, tracking) for u in urls], [parse_crawl_date(d) for d in dates])
    assert dedup.drops == [(0, "url_dedup", "d1"), (3, "url_dedup", "d4")]
    assert dedup.alive == [1, 2, 4]
    assert st.docs_in == 5 and st.docs_out == 3 and st.dropped == {"url_dedup": 2}
    assert st.bytes_in == 230 and st.bytes_out == 100 and st.balanced()
