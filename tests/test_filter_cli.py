"""`crucible filter` (infra.cli.filter): decisions per JSONL document, with and without langid."""
from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from infra.cli.filter import add_arguments, filter_file, run
from tasks.config import DATA_ROOT_ENV, DEFAULT_DATA_ROOT, CurateConfig

REPO = Path(__file__).resolve().parent.parent
CC_MAIN = Path(os.environ.get(DATA_ROOT_ENV) or DEFAULT_DATA_ROOT) / "web" / "cc-main-2019-30-sample.jsonl.gz"

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


@pytest.fixture
def real_docs(tmp_path):
    """30 real Common Crawl pages, with a blank line, a bad line and a document without id among them."""
    if not CC_MAIN.exists():
        pytest.skip(f"no data at {CC_MAIN}")
    with gzip.open(CC_MAIN, "rt") as f:
        rows = [json.loads(line) for _, line in zip(range(30), f)]
    lines = [json.dumps({"id": r["id"], "text": r["text"]}) for r in rows]
    lines[10:10] = ["", "not json"]
    lines[20] = json.dumps({"text": rows[18]["text"]})
    path = tmp_path / "real.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_workers_write_the_same_decisions_as_one(real_docs, tmp_path):
    """--workers 2 decides in forked processes and writes byte for byte what --workers 1 writes
    (input order; line numbers and default ids count from the start of the file)."""
    outs = {}
    for workers in (1, 2):
        out = tmp_path / f"w{workers}.jsonl"
        summary = filter_file(real_docs, out, CurateConfig(), workers=workers)
        assert summary["docs"] == 31 and summary["workers"] == workers
        assert (summary["worker_processes"] >= 1) == (workers > 1)
        outs[workers] = out.read_bytes()
    assert outs[1] == outs[2]
    dec = [json.loads(line) for line in outs[2].splitlines()]
    assert dec[10] == {"id": None, "line": 12, "keep": False, "reason": "bad_input", "scores": {}}
    assert dec[19]["id"] == "line-21"
    assert any(d["keep"] for d in dec) and len({d["reason"] for d in dec}) > 3


def test_filter_command_imports_no_heavy_stack(real_docs, tmp_path):
    """`crucible filter` starts small: no Prefect, Ray, torch or MLflow in the process (spaCy's
    thinc would import torch, 0.7 s, if the tokenizer did not hide it)."""
    code = ("import json, sys; from infra.cli import main; rc = main(sys.argv[1:]); "
            "print(json.dumps([rc, sorted(m for m in sys.modules if m.split('.')[0] in "
            "('prefect', 'ray', 'torch', 'mlflow', 'spacy', 'fasttext'))]))")
    out = tmp_path / "dec.jsonl"
    proc = subprocess.run([sys.executable, "-c", code, "filter", str(real_docs), "--out", str(out), "--workers", "1"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rc, loaded = json.loads(proc.stdout.splitlines()[-1])
    assert rc == 0 and len(out.read_text().splitlines()) == 31
    assert "spacy" in loaded and "fasttext" in loaded  # the real filter path ran
    assert not [m for m in loaded if m.split(".")[0] in ("prefect", "ray", "torch", "mlflow")], loaded
