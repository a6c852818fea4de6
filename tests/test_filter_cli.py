"""`crucible filter` (infra.cli.filter): decisions per JSONL document, with and without langid."""
from __future__ import annotations

import argparse
import json

import pytest

from infra.cli.filter import add_arguments, run

GOOD = ("The kernel documentation explains how modules are loaded at boot. Each driver registers its devices "
        "with the bus it sits on, and the core then matches drivers to devices by their identifiers. When a "
        "match is found, the probe function of the driver is called with the device. If probing fails, the "
        "kernel logs the error and carries on with the next driver in the list. This design keeps the boot "
        "process robust even when some hardware is missing or broken.\n"
        "Administrators can list the loaded modules with a single command, and they can add options to a "
        "configuration file so that the right parameters are passed every time the system starts up again.")
GERMAN = ("Die Dokumentation des Kernels erklärt, wie Module beim Start geladen werden. Jeder Treiber meldet "
          "seine Geräte bei dem Bus an, an dem sie hängen, und der Kern ordnet dann Treiber und Geräte anhand "
          "ihrer Kennungen einander zu. Wenn eine Zuordnung gefunden wird, wird die Funktion des Treibers "
          "aufgerufen. Schlägt das fehl, protokolliert der Kernel den Fehler und macht weiter.")


def _args(argv):
    return add_arguments(argparse.ArgumentParser()).parse_args(argv)


@pytest.fixture
def infile(tmp_path):
    p = tmp_path / "docs.jsonl"
    rows = [{"id": "good", "text": GOOD}, {"id": "short", "text": "Too short to keep."},
            {"id": "de", "text": GERMAN}, {"id": "lorem", "text": GOOD + "\nLorem ipsum dolor sit amet, consectetur."}]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\nnot json\n")
    return p


def test_filter_with_langid(infile, tmp_path):
    out = tmp_path / "dec.jsonl"
    assert run(_args([str(infile), "--out", str(out)])) == 0
    dec = [json.loads(line) for line in out.read_text().splitlines()]
    by_id = {d["id"]: d for d in dec}
    assert [d["id"] for d in dec] == ["good", "short", "de", "lorem", None]
    assert by_id["good"]["keep"] is True and by_id["good"]["reason"] is None
    assert by_id["good"]["scores"]["langid"]["label"] == "en" and by_id["good"]["scores"]["langid"]["score"] > 0.65
    assert by_id["good"]["scores"]["words"] > 50 and 3 < by_id["good"]["scores"]["mean_word_length"] < 10
    assert by_id["short"]["keep"] is False and by_id["short"]["reason"].startswith("gopher_")
    assert by_id["de"]["reason"] == "langid:de" and by_id["de"]["scores"]["langid"]["label"] == "de"
    assert by_id["lorem"]["reason"] == "c4:lorem_ipsum"
    assert dec[-1]["reason"] == "bad_input" and dec[-1]["keep"] is False


def test_filter_no_langid_and_overrides(infile, tmp_path):
    out = tmp_path / "dec.jsonl"
    assert run(_args([str(infile), "--out", str(out), "--no-langid",
                      "--set", "curate.gopher_quality.min_doc_words=2",
                      "--set", "curate.c4.min_num_sentences=1"])) == 0
    by_id = {d["id"]: d for d in map(json.loads, out.read_text().splitlines())}
    assert "langid" not in by_id["good"]["scores"]
    assert by_id["good"]["keep"] and by_id["de"]["reason"] != "langid:de"


def test_filter_with_config_file(infile, tmp_path):
    from pathlib import Path

    cfg = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"
    out = tmp_path / "dec.jsonl"
    assert run(_args([str(infile), "--out", str(out), "--config", str(cfg), "--no-langid",
                      "--set", "curate.c4.filter_lorem_ipsum=false"])) == 0
    by_id = {d["id"]: d for d in map(json.loads, out.read_text().splitlines())}
    assert by_id["lorem"]["reason"] != "c4:lorem_ipsum"
