"""PII redaction: crafted positives and negatives (versions, dates, section numbers, private
and documentation IPs), real web text from shared/data, and the per-source policy of the step."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tasks.config import DATA_ROOT_ENV, DEFAULT_DATA_ROOT, CurateConfig, IngestConfig, SourceConfig
from tasks.curate.filters import build_filters
from tasks.curate.pii import PiiRedactor, redact_pii

DATA = Path(os.environ.get(DATA_ROOT_ENV) or DEFAULT_DATA_ROOT)
WEB = DATA / "web"


@pytest.mark.parametrize("text,expected,kind", [
    ("Write to john.doe@example.com today.", "Write to <EMAIL> today.", "email"),
    ("cc: Jane_D+news@mail.example.co.uk,", "cc: <EMAIL>,", "email"),
    ("mailto:a.b@c.org", "mailto:<EMAIL>", "email"),
    ("from 93.184.216.34 at noon", "from <IP_ADDRESS> at noon", "ip_address"),
    ("connect to 203.0.114.7:8080", "connect to <IP_ADDRESS>:8080", "ip_address"),
    ("host 2a00:1450:4001:82a::200e up", "host <IP_ADDRESS> up", "ip_address"),
    ("Call (555) 123-4567 now", "Call <PHONE> now", "phone"),
    ("Call 555-123-4567.", "Call <PHONE>.", "phone"),
    ("or 1-800-555-1234", "or <PHONE>", "phone"),
    ("Tel. +44 20 7946 0958", "Tel. <PHONE>", "phone"),
    ("Telefon: +49 561 9804848 E-Mail", "Telefon: <PHONE> E-Mail", "phone"),
    ("Reach Us +441474556909 now", "Reach Us <PHONE> now", "phone"),
])
def test_redacts(text, expected, kind):
    out, counts = redact_pii(text)
    assert out == expected
    assert counts == {kind: 1}


@pytest.mark.parametrize("text", [
    "Python 3.11.2 was released on 2023-02-08 (08.02.2023, 2/8/2023 10:30:45).",
    "util-linux-ng 2.13.1.1 and kernel 6.1.0-13-amd64; see section 4.2.13.1, “Guided”.",
    "8.2.2.1. Installing the required packages",
    "11.2.4.1. Requiring Authentication\nIn some cases",
    "address 192.168.0.3/24 gateway 10.0.0.1, loopback 127.0.0.1, mask 255.255.255.0",
    "documentation nets 192.0.2.5, 198.51.100.7 and 2001:db8::1, link-local fe80::1",
    "std::vector<int> a; foo::bar::baz(); at 10:46:17 on 27/06/2019",
    "ISBN 978-3-16-148410-0, order 12345678901, price 1,234,567.89, pi 3.141592653589",
    "user@localhost is not routable and foo@bar has no TLD",
    "1.2.3.4.5 is an outline number; so is v1.22.333.4",
])
def test_leaves_non_pii_alone(text):
    out, counts = redact_pii(text)
    assert out == text, counts
    assert not counts


def test_kinds_can_be_limited():
    text = "a@example.com 93.184.216.34 555-123-4567"
    assert redact_pii(text, ["email"])[0] == "<EMAIL> 93.184.216.34 555-123-4567"
    assert redact_pii(text, ["phone", "ip_address"])[0] == "a@example.com <IP_ADDRESS> <PHONE>"


def test_step_follows_source_policy_and_counts():
    f = PiiRedactor(["email", "ip_address", "phone"], {"web": "redact", "code": "keep"})
    docs = [{"id": "1", "source": "web", "text": "mail a@example.com or b@example.org, call 555-123-4567"},
            {"id": "2", "source": "code", "text": "mail a@example.com"},
            {"id": "3", "source": "unregistered", "text": "from 93.184.216.34"},
            {"id": "4", "source": "web", "text": "nothing to see"}]
    assert all(f.decide(d) is None for d in docs)  # never drops
    assert docs[0]["text"] == "mail <EMAIL> or <EMAIL>, call <PHONE>"
    assert docs[1]["text"] == "mail a@example.com"  # keep policy
    assert docs[2]["text"] == "from <IP_ADDRESS>"  # default policy: redact
    assert f.drain() == {"replacements": {"web": {"email": 2, "phone": 1}, "unregistered": {"ip_address": 1}},
                         "docs_changed": {"web": 1, "unregistered": 1}}
    assert f.drain() == {"replacements": {}, "docs_changed": {}}


def test_build_filters_places_pii_last():
    cur = CurateConfig(langid={"enabled": False})
    names = [f.name for f in build_filters(cur, pii_policies={})]
    assert names[-1] == "pii"
    assert "pii" not in [f.name for f in build_filters(cur)]  # the heuristic chain alone (crucible filter)


@pytest.mark.skipif(not (WEB / "cc-main-2019-30-sample.jsonl.gz").exists(), reason=f"no data under {DATA}")
def test_real_web_text():
    from tasks.ingest.process import process_file_range

    path = str(WEB / "cc-main-2019-30-sample.jsonl.gz")
    src = SourceConfig(name="cc", uri=path, format="jsonl", licence="t", provenance="t")
    docs = {d["url"]: d["text"] for d in process_file_range(src, path, IngestConfig())["docs"]}
    job = docs["http://www.jobboerse-werder.de/arbeitgeber/gesundheit-nordhessen-holding-ag--2158.html"]
    out, counts = redact_pii(job)
    assert "karriere@gnh.net" in job and "karriere@gnh.net" not in out
    assert "Telefon: <PHONE>\nE-Mail: <EMAIL>\nHomepage" in out
    assert counts["email"] >= 1 and counts["phone"] >= 1
    wiki = next(t for u, t in docs.items() if "195.234.74.142" in t)  # an anonymous editor's IP
    out, counts = redact_pii(wiki)
    assert "195.234.74.142" not in out and counts["ip_address"] >= 1
    # across the sample: every placeholder replaces something, nothing else changes length wildly
    total = {"email": 0, "ip_address": 0, "phone": 0}
    for text in docs.values():
        out, counts = redact_pii(text)
        for k, v in counts.items():
            total[k] += v
        assert (out == text) == (not counts)
    assert total["email"] >= 50 and total["phone"] >= 10 and total["ip_address"] >= 1
