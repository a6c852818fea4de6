"""Curate at scale on the real stage: the driver's peak memory and the throughput by corpus size.

A corpus is generated from the real paragraphs of ../shared/data/text/gutenberg (fixed seed):
each document is random passages (≥ 60 words of consecutive lines) up to ~3.6 KB; 10 % of the documents are near
duplicates of an earlier one (3 % of the words replaced) and 2 % exact copies. It is written as
ingested shards (Parquet, 500-row groups, like `tasks.ingest`) and run through the real
`run_curate` in a fresh process per size, on local Ray. That process (the driver) samples its own
RSS every 0.2 s and reports its peak (and `ru_maxrss`), the wall time, docs/s per core, the
result bytes the jobs sent to the driver, and the dedup counts.

`--filters dedup` (the default) keeps the text filters off so the run measures the dedup stages
and the driver (the filters run inside the workers and add no driver state); `--filters all`
runs the whole default chain. `--code ROOT` runs another checkout's `tasks` (e.g. the code
before issue 26, `git archive 0893e0b tasks | tar -x -C /tmp/old`) on the same corpus.

    .venv/bin/python benchmarks/curate_scale.py --docs 20000 100000 [--code /tmp/old] [--out results.json]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os, resource, sys, threading, time
from pathlib import Path

peak = [0]
def sample():
    while True:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    peak[0] = max(peak[0], int(line.split()[1]) * 1024)
        time.sleep(0.2)
threading.Thread(target=sample, daemon=True).start()

from tasks.config import PipelineConfig
from tasks.curate import run_curate
args = json.loads(sys.argv[1])
cfg = PipelineConfig.model_validate(args["cfg"])
t0 = time.perf_counter()
s = run_curate(cfg, [Path(p) for p in args["shards"]], Path(args["out"]))
wall = time.perf_counter() - t0
print("RESULT " + json.dumps({"wall_s": round(wall, 2), "driver_peak_rss_bytes": peak[0],
      "driver_ru_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
      "docs_in": s["docs_in"], "docs_out": s["docs_out"], "dropped": s["dropped"],
      "result_bytes": s.get("timings", {}).get("jobs", {}).get("result_bytes"),
      "timings": {k: v for k, v in s.get("timings", {}).items() if k != "jobs"}}))
"""


def paragraphs(words: int = 60) -> list[str]:
    """Passages of ≥ `words` words: consecutive lines of the Gutenberg texts (one sentence or
    verse per line there, no blank lines between paragraphs)."""
    data = Path(os.environ.get("CRUCIBLE_DATA_ROOT") or ROOT.parent / "shared" / "data")
    out = []
    for p in sorted((data / "text" / "gutenberg").glob("*.txt")):
        cur: list[str] = []
        n = 0
        for line in p.read_text(encoding="utf-8", errors="replace").splitlines():
            line = " ".join(line.split())
            if not line:
                continue
            cur.append(line)
            n += len(line.split())
            if n >= words:
                out.append(" ".join(cur))
                cur, n = [], 0
    return out


def corpus(n: int, seed: int = 0, doc_bytes: int = 3600) -> list[dict]:
    """`n` documents: random paragraphs (~`doc_bytes`), 10 % near duplicates, 2 % exact copies."""
    rng = random.Random(seed)
    paras = paragraphs()
    docs: list[dict] = []
    for i in range(n):
        r = rng.random()
        if docs and r < 0.10:
            words = rng.choice(docs)["text"].split(" ")
            for _ in range(max(1, len(words) * 3 // 100)):
                words[rng.randrange(len(words))] = rng.choice(("the", "of", "and", "a", "to", "in"))
            text = " ".join(words)
        elif docs and r < 0.12:
            text = rng.choice(docs)["text"]
        else:
            parts, size = [], 0
            while size < doc_bytes:
                parts.append(rng.choice(paras))
                size += len(parts[-1]) + 2
            text = "\n\n".join(parts)
        docs.append({"id": f"d{i:08d}", "text": text, "source": "gutenberg-mix", "url": None})
    return docs


def config(filters: str, cpus: int) -> dict:
    """The run's config as plain data (validated in the child, by the checkout that runs)."""
    off = {"enabled": False}
    curate = {} if filters == "all" else {k: off for k in ("langid", "gopher_quality", "gopher_repetition", "c4",
                                                            "fineweb", "decontam", "pii")}
    if filters != "all":
        curate["dedup"] = {"lines": off}
    curate["resume"] = False
    return {"name": "curate-scale", "sources": [
        {"name": "gutenberg-mix", "uri": "text/gutenberg/*", "format": "text", "licence": "public domain",
         "provenance": "shared/data"}], "ray": {"num_cpus": cpus}, "curate": curate}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, nargs="+", default=[20_000, 100_000])
    ap.add_argument("--filters", choices=("dedup", "all"), default="dedup")
    ap.add_argument("--cpus", type=int, default=2)
    ap.add_argument("--code", default=str(ROOT), help="the checkout whose `tasks` runs (default: this one)")
    ap.add_argument("--out", help="write the results here (JSON)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from tasks.core.documents import ShardWriter

    results = []
    for n in args.docs:
        with tempfile.TemporaryDirectory() as d:
            with ShardWriter(Path(d) / "in", shard_docs=50_000, row_group_docs=500) as w:
                w.write_many(corpus(n))
            payload = {"cfg": config(args.filters, args.cpus), "shards": [str(p) for p in w.paths],
                       "out": str(Path(d) / "out")}
            env = {**os.environ, "PYTHONPATH": args.code}
            proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(payload)], cwd=args.code, env=env,
                                  capture_output=True, text=True)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"run with {n} docs failed:\n{proc.stderr[-4000:]}")
            res = {"docs": n, "filters": args.filters, "code": args.code, **json.loads(line[7:])}
            res["docs_per_s_per_core"] = round(n / res["wall_s"] / args.cpus, 1)
            print(json.dumps(res), flush=True)
            results.append(res)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
