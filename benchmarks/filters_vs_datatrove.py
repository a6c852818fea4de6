"""`crucible filter` vs datatrove's filter chain on the same real documents, each run as its users run it.

Documents: the text that the ingest stage extracts from ../shared/data/web (docs-crawl WARC
shards, wget sample, whirlwind, plus the Common Crawl JSONL samples), extracted once by
`extraction.py` and cached (default: $TMPDIR/crucible-bench-web), written once more as JSONL
`{"id", "text"}` for both tools.

Chain, in FineWeb's order and with FineWeb's settings: Gopher repetition → Gopher quality → C4
(`filter_no_terminal_punct=False`) → FineWeb quality, every threshold from the default
`CurateConfig`. Language id is off on both sides for the comparison (datatrove's chain has none);
`crucible filter` with it is timed too, for reference.

* Crucible: the `crucible filter INPUT --out DECISIONS --no-langid --workers W` command, a whole
  process (start-up, reading, writing included).
* datatrove (the `bench` extra): a Python process running its `LocalPipelineExecutor` (default
  start method) over `JsonlReader` → the four filters (each with an exclusion `JsonlWriter`, so
  every drop and its reason is on disk) → `JsonlWriter`, uncompressed, `workers=W`. datatrove
  parallelises by input file, so it gets the same documents as 4·W contiguous files and
  `tasks=4·W` (Crucible cuts its input into 4·W ranges too). Its process imports nothing of
  Crucible (the config reaches it as JSON).

Both are timed by wall clock (the figure the target is about), Crucible's CPU seconds too (for
reference; datatrove's pool runs under a forkserver whose CPU time cannot be collected); with `--repeats` > 1 runs interleave and the best is kept. Start-up is measured
on its own: each tool on a one-document input, best of three (`crucible filter` with and
without language id). Decisions: `crucible filter --workers 1` must write byte for byte the
file that `--workers W` writes, and Crucible's reason per id is compared with datatrove's
(filter name and rule); disagreeing documents are kept in the results for inspection.

Writes benchmarks/results/filters_vs_datatrove.json; `within_target`: speed-up ≥ 3× by wall
clock, every decision the same as datatrove's, and the same output for 1 and W workers.

    python benchmarks/filters_vs_datatrove.py [--cache DIR] [--docs N] [--workers 2] [--repeats 1]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CHUNKS_PER_WORKER = 4
_DT_NAMES = ("gopher_repetition", "gopher_quality", "c4", "fineweb")
TARGET_SPEEDUP = 3.0


def datatrove_chain(sections: dict, exclusion_writer=lambda name: None) -> list:
    """datatrove's filters with the thresholds of the config `sections` (plain dicts, as dumped)."""
    from datatrove.pipeline.filters import (C4QualityFilter, FineWebQualityFilter, GopherQualityFilter,
                                            GopherRepetitionFilter)

    gr, gq, c4, fw = (sections[name] for name in _DT_NAMES)
    return [
        GopherRepetitionFilter(dup_line_frac=gr["dup_line_frac"], dup_para_frac=gr["dup_para_frac"],
                               dup_line_char_frac=gr["dup_line_char_frac"],
                               dup_para_char_frac=gr["dup_para_char_frac"],
                               top_n_grams=tuple(sorted((int(n), f) for n, f in gr["top_n_grams"].items())),
                               dup_n_grams=tuple(sorted((int(n), f) for n, f in gr["dup_n_grams"].items())),
                               exclusion_writer=exclusion_writer("gopher_repetition")),
        GopherQualityFilter(min_doc_words=gq["min_doc_words"], max_doc_words=gq["max_doc_words"],
                            min_avg_word_length=gq["min_avg_word_length"],
                            max_avg_word_length=gq["max_avg_word_length"],
                            max_symbol_word_ratio=gq["max_symbol_word_ratio"],
                            max_bullet_lines_ratio=gq["max_bullet_lines_ratio"],
                            max_ellipsis_lines_ratio=gq["max_ellipsis_lines_ratio"],
                            max_non_alpha_words_ratio=gq["max_non_alpha_words_ratio"],
                            min_stop_words=gq["min_stop_words"], stop_words=list(gq["stop_words"]),
                            exclusion_writer=exclusion_writer("gopher_quality")),
        C4QualityFilter(split_paragraph=True, remove_citations=c4["remove_citations"],
                        filter_no_terminal_punct=c4["filter_no_terminal_punct"],
                        min_num_sentences=c4["min_num_sentences"], min_words_per_line=c4["min_words_per_line"],
                        max_word_length=c4["max_word_length"], filter_lorem_ipsum=c4["filter_lorem_ipsum"],
                        filter_javascript=c4["filter_javascript"], filter_curly_bracket=c4["filter_curly_bracket"],
                        filter_policy=c4["filter_policy"], exclusion_writer=exclusion_writer("c4")),
        FineWebQualityFilter(line_punct_thr=fw["line_punct_thr"], line_punct_exclude_zero=fw["line_punct_exclude_zero"],
                             short_line_thr=fw["short_line_thr"], short_line_length=fw["short_line_length"],
                             char_duplicates_ratio=fw["char_duplicates_ratio"], new_line_ratio=fw["new_line_ratio"],
                             exclusion_writer=exclusion_writer("fineweb")),
    ]


def datatrove_process(spec_path: str) -> None:
    """The datatrove side, in its own process: reader → chain → writer on the local executor."""
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers import JsonlWriter

    spec = json.loads(Path(spec_path).read_text())
    out = spec["out"]
    chain = datatrove_chain(spec["sections"],
                            lambda name: JsonlWriter(f"{out}/excluded/{name}", compression=None))
    LocalPipelineExecutor(pipeline=[JsonlReader(spec["input"]), *chain, JsonlWriter(f"{out}/kept", compression=None)],
                          tasks=spec["tasks"], workers=spec["workers"], logging_dir=f"{out}/logs").run()


def datatrove_decisions(out: Path) -> dict[str, str | None]:
    """id → None (kept) or "<filter>:<rule>", from the kept and the per-filter exclusion files."""
    decisions: dict[str, str | None] = {}
    for f in sorted((out / "kept").glob("*.jsonl")):
        decisions.update((json.loads(line)["id"], None) for line in f.open())
    for name in _DT_NAMES:
        for f in sorted((out / "excluded" / name).glob("*.jsonl")):
            for line in f.open():
                d = json.loads(line)
                decisions[d["id"]] = f"{name}:{d.get('metadata', {}).get('filter_reason') or 'rejected'}"
    return decisions


def _timed(cmd: list[str], log: Path) -> dict:
    """Run `cmd` to completion: wall seconds and CPU seconds of it and its waited-for children."""
    before = os.times()
    t0 = time.perf_counter()
    with log.open("w") as fh:
        proc = subprocess.run(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t0
    after = os.times()
    if proc.returncode != 0:
        sys.exit(f"{cmd[:4]} failed ({proc.returncode}); see {log}")
    cpu = after.children_user - before.children_user + after.children_system - before.children_system
    return {"wall_s": round(wall, 3), "cpu_s": round(cpu, 3)}


def crucible_cmd(inp: Path, out: Path, workers: int, langid: bool = False) -> list[str]:
    exe = Path(sys.executable).with_name("crucible")  # the console script, as a user runs it
    head = [str(exe)] if exe.is_file() else [sys.executable, "-m", "infra.cli"]
    return head + ["filter", str(inp), "--out", str(out), "--workers", str(workers)] + ([] if langid else ["--no-langid"])


def datatrove_cmd(work: Path, inp_dir: Path, out: Path, workers: int, tasks: int, sections: dict) -> list[str]:
    if out.exists():
        shutil.rmtree(out)
    spec = work / f"{out.name}.spec.json"
    spec.write_text(json.dumps({"input": str(inp_dir), "out": str(out), "tasks": tasks, "workers": workers,
                                "sections": sections}))
    return [sys.executable, str(Path(__file__).resolve()), "--datatrove-process", str(spec)]


def write_inputs(docs: list[dict], work: Path, parts: int) -> tuple[Path, Path, Path]:
    """One JSONL file (Crucible), the same as `parts` contiguous files (datatrove), a one-document file."""
    lines = [json.dumps({"id": d["id"], "text": d["text"]}, ensure_ascii=False) + "\n" for d in docs]
    whole, split, one = work / "docs.jsonl", work / "docs_split", work / "one" / "one.jsonl"
    whole.write_text("".join(lines), encoding="utf-8")
    split.mkdir(exist_ok=True)
    step = -(-len(lines) // parts)
    for k in range(parts):
        (split / f"part-{k:05d}.jsonl").write_text("".join(lines[k * step:(k + 1) * step]), encoding="utf-8")
    one.parent.mkdir(exist_ok=True)
    one.write_text(lines[0], encoding="utf-8")
    return whole, split, one


def measure_startup(work: Path, one: Path, sections: dict) -> dict:
    """Each tool on a one-document input, best wall clock of three (wall only: see `run_all`)."""
    runs = {"crucible_filter": lambda: crucible_cmd(one, work / "one.out", 1),
            "crucible_filter_with_langid": lambda: crucible_cmd(one, work / "one.out", 1, langid=True),
            "datatrove": lambda: datatrove_cmd(work, one.parent, work / "dt_one", 1, 1, sections)}
    return {name: min(_timed(make(), work / "startup.log")["wall_s"] for _ in range(3))
            for name, make in runs.items()}


def crucible_decisions(path: Path) -> dict[str, str | None]:
    return {d["id"]: d["reason"] for d in map(json.loads, path.open())}


def compare(docs: list[dict], ours: dict, theirs: dict, show: int) -> dict:
    ids = [d["id"] for d in docs]
    a, b = [ours.get(i, "missing") for i in ids], [theirs.get(i, "missing") for i in ids]
    n = len(ids)
    disagree = [k for k in range(n) if (a[k] is None) != (b[k] is None)]
    return {
        "keep_drop_agreement": round(sum((x is None) == (y is None) for x, y in zip(a, b)) / n, 5),
        "rule_agreement": round(sum(x == y for x, y in zip(a, b)) / n, 5),
        "disagreements": len(disagree),
        "disagreement_pairs": dict(Counter(f"{a[k] or 'keep'} | {b[k] or 'keep'}" for k in disagree).most_common()),
        "disagreeing_docs": [{"id": ids[k], "source_file": docs[k].get("source_file"), "crucible": a[k],
                              "datatrove": b[k], "text_head": docs[k]["text"][:300]} for k in disagree[:show]],
        "crucible_kept": sum(x is None for x in a), "datatrove_kept": sum(y is None for y in b),
        "crucible_reasons": dict(Counter(x for x in a if x).most_common()),
    }


def run_all(args, docs: list[dict], work: Path) -> dict:
    from tasks.config import CurateConfig

    sections = CurateConfig().model_dump(include=set(_DT_NAMES))
    w = args.workers
    whole, split, one = write_inputs(docs, work, CHUNKS_PER_WORKER * w)
    print("start-up (one document) ...", file=sys.stderr)
    startup = measure_startup(work, one, sections)
    best: dict[str, dict] = {}
    for r in range(args.repeats):
        for name, make in (("crucible", lambda: crucible_cmd(whole, work / "crucible.out", w)),
                           ("datatrove", lambda: datatrove_cmd(work, split, work / "dt", w, CHUNKS_PER_WORKER * w,
                                                               sections))):
            t = _timed(make(), work / f"{name}.log")
            if name == "datatrove":  # its pool runs under a forkserver, whose CPU time never reaches us
                t.pop("cpu_s")
            print(f"  run {r + 1}: {name} {t['wall_s']} s wall, {t.get('cpu_s', '-')} CPU s", file=sys.stderr)
            if name not in best or t["wall_s"] < best[name]["wall_s"]:
                best[name] = t
    single = _timed(crucible_cmd(whole, work / "crucible.w1.out", 1), work / "crucible.w1.log")
    langid = _timed(crucible_cmd(whole, work / "crucible.langid.out", w, langid=True), work / "crucible.langid.log")
    same_output = (work / "crucible.out").read_bytes() == (work / "crucible.w1.out").read_bytes()
    agreement = compare(docs, crucible_decisions(work / "crucible.out"), datatrove_decisions(work / "dt"), args.show)
    return {"startup": startup, "best": best, "single": single, "langid": langid, "same_output": same_output,
            "agreement": agreement}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cache", default=None, help="extracted documents (default: extraction.py's cache)")
    p.add_argument("--docs", type=int, default=None, help="use only the first N documents")
    p.add_argument("--workers", type=int, default=2, help="processes for each tool (the comparison is on 2 cores)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--show", type=int, default=40, help="disagreeing documents kept in the results")
    p.add_argument("--work", default=None, help="scratch directory (default: a temporary one, removed)")
    p.add_argument("--out", default=str(HERE / "results" / "filters_vs_datatrove.json"))
    p.add_argument("--datatrove-process", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.datatrove_process:
        datatrove_process(args.datatrove_process)
        return {}
    from importlib.metadata import version
    from importlib.util import find_spec

    if find_spec("datatrove") is None or find_spec("spacy") is None:
        sys.exit("this benchmark needs the 'bench' extra: .venv/bin/pip install -e '.[bench]'")
    sys.path.insert(0, str(HERE))

    from _common import write_result
    from extraction import DEFAULT_CACHE, load_web_docs

    docs = load_web_docs(Path(args.cache or DEFAULT_CACHE))[:args.docs]
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="filters-vs-datatrove-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        m = run_all(args, docs, work)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    result = report(args, docs, m, version)
    write_result(args.out, result, indent=1, ensure_ascii=False)
    print(f"wrote {args.out}")
    return result


def report(args, docs: list[dict], m: dict, version) -> dict:
    n, best, agree = len(docs), m["best"], m["agreement"]
    speedup = round(best["datatrove"]["wall_s"] / best["crucible"]["wall_s"], 2)
    result = {
        "documents": n, "source_files": dict(Counter(d["source_file"] for d in docs)),
        "chain": "gopher_repetition -> gopher_quality -> c4 (filter_no_terminal_punct=False) -> fineweb",
        "datatrove_version": version("datatrove"), "spacy_version": version("spacy"),
        "machine": {"cores_usable": len(os.sched_getaffinity(0)), "load_avg_at_end": os.getloadavg()},
        "workers": args.workers,
        "timing": "wall clock of the whole process (start-up, reading, writing included), best of --repeats; "
                  "Crucible's CPU seconds (process and its workers) for reference",
        "startup_one_document": m["startup"],
        "crucible": {**best["crucible"], "docs_per_s": round(n / best["crucible"]["wall_s"], 1),
                     "command": "crucible filter docs.jsonl --out decisions.jsonl --no-langid "
                                f"--workers {args.workers}"},
        "crucible_single_worker": {**m["single"], "docs_per_s": round(n / m["single"]["wall_s"], 1)},
        "crucible_with_langid": {**m["langid"], "docs_per_s": round(n / m["langid"]["wall_s"], 1)},
        "datatrove": {**best["datatrove"], "docs_per_s": round(n / best["datatrove"]["wall_s"], 1),
                      "executor": f"LocalPipelineExecutor(tasks={CHUNKS_PER_WORKER * args.workers}, "
                                  f"workers={args.workers}), JsonlReader -> 4 filters -> JsonlWriter"},
        "speedup_wall": speedup,
        "same_output_1_and_n_workers": m["same_output"],
        **agree,
        "targets": {"speedup_min": TARGET_SPEEDUP, "rule_agreement": 1.0, "same_output_1_and_n_workers": True},
    }
    result["within_target"] = bool(speedup >= TARGET_SPEEDUP and agree["rule_agreement"] == 1.0 and m["same_output"])
    st = m["startup"]
    print(f"{n} documents, {args.workers} workers: crucible filter {best['crucible']['wall_s']} s, "
          f"datatrove {best['datatrove']['wall_s']} s wall -> {speedup}x; start-up {st['crucible_filter']} s "
          f"(datatrove {st['datatrove']} s); same rule {100 * agree['rule_agreement']:.2f} %, "
          f"{agree['disagreements']} keep/drop disagreements; 1 vs {args.workers} workers identical: "
          f"{m['same_output']}")
    return result


if __name__ == "__main__":
    main()
