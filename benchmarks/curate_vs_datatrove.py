"""Crucible's ingest + curate vs datatrove's FineWeb-style pipeline on the same corpus, whole processes.

Corpus: `curate_scale.corpus` (real Gutenberg passages, fixed seed, ~3.6 KB English documents,
10 % near duplicates, 2 % exact copies, each copy's original known), written as 8 JSONL files
(4 per worker: datatrove parallelises by input file; Crucible's ingest runs one job per file too).

* datatrove 0.10.1 (the `bench` extra), one Python process importing nothing of Crucible:
  `LocalPipelineExecutor(tasks=8, workers=2)` over JsonlReader → LanguageFilter (en, 0.65) →
  GopherRepetition → GopherQuality → C4 (`filter_no_terminal_punct=False`) → FineWebQuality
  (every filter with an exclusion writer, thresholds from Crucible's default `CurateConfig`) →
  JsonlWriter + MinhashDedupSignature (5-grams, 14 × 8, as FineWeb); then MinhashDedupBuckets
  (14 tasks), MinhashDedupCluster (1 task), and JsonlReader → MinhashDedupFilter (exclusion
  writer) → JsonlWriter. Two deviations, both for this machine: the language model is the
  lid.176.ftz file Crucible uses (datatrove would download lid.176.bin; there is no network),
  loaded directly because `fasteners` (which datatrove's download lock needs) is not installed,
  and the pool uses the "fork" start method so these patches reach the workers; and datatrove's
  xxhash shingle hash gets UTF-8 bytes (xxhash 4, installed, refuses str; older xxhash encoded it).
* Crucible, one Python process: `run_ingest` then `run_curate` (the functions the flow's ingest and
  curate stages run) with the default config (line dedup, language id, the same filters,
  decontamination, PII, URL + exact + MinHash dedup), local Ray with 2 CPUs, resume off. MinHash:
  Crucible's defaults as a user runs them (JSON `minhash_settings`): the same 5-word shingles and
  112 signature values as datatrove (seed 1), banded 28 x 4 instead of 14 x 8, every candidate pair
  checked by its exact shingle Jaccard (>= 0.7) and every dropped member by its Jaccard to the kept
  document (>= 0.7); datatrove keeps one document per LSH component, unchecked. What differs in
  the shingles and hashes is in `SHINGLING_DIFFERENCES`. The recall runs add a third side,
  Crucible with datatrove's LSH (`CRUCIBLE_FINEWEB_LSH`: 14 x 8, unchecked components), for what
  the defaults gain and what their verification costs (wall and CPU seconds) on the same corpora.

Both are timed by wall clock from process start to exit, and by the CPU seconds (user + system)
of each one's whole process tree (Ray's processes, datatrove's pool): on a loaded machine the two
tools' process mixes slow down differently, so the CPU ratio is the steadier guide there; the
target is the wall-clock one on a quiet machine. Near-duplicate recall varies by chance on one
corpus (~0.02 over its ~300 copies), so the recall target compares the mean over `--recall-seeds`
corpora (seeds 0..N-1) of each side's MinHash dedup alone, its own code path, every document in
(datatrove: signature, buckets, cluster, filter steps; Crucible: ingest + the curate stage with
every other step off), with standard errors (each mean's and the paired difference's), beside the
false drops (precision: no more than datatrove's); the main run's recall and false drops are
targets too. Reported: docs/s and the ratio, kept
counts, per-document agreement of the language + filter keep/drop decisions (documents that
Crucible's own extra steps dropped, line dedup's too-short and decontamination, are counted apart),
near-duplicate recall against the generator's known copies (per duplicate group: the copies that
passed the tool's filters, minus the one kept, are the ones to remove) and false dedup drops, and
Crucible's time per step (ingest, line counts, each filter's CPU seconds in the map, dedup, write).
`hash_draws` (JSON `near_dup_candidates_over_hash_draws`) says whether either hash family is
biased: on the recall corpora, at datatrove's 14 x 8 banding, the planted near pairs' shingle
Jaccard under each side's own shingling, and the share of them that become LSH candidates under
each side's own signature code for hash seeds 1..`--hash-draws` (the same seeds both sides), with
its excess over the exact expectation from each pair's Jaccard and standard errors; and for
Crucible alone (cheap signatures) the excess over `--bias-draws` seeds, tight enough to see a bias
of a few thousandths.

    .venv/bin/python benchmarks/curate_vs_datatrove.py [--docs 3000] [--recall-seeds 4] [--hash-draws 8] [--bias-draws 100] [--work DIR]

Writes benchmarks/results/curate_vs_datatrove.json.
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
WORKERS = 2
FILES = 4 * WORKERS
TARGET_SPEEDUP = 4.0
TARGET_AGREEMENT = 0.995
_FILTERS = ("langid", "gopher_repetition", "gopher_quality", "c4", "fineweb")
_DEDUP_STEPS = ("url_dedup", "exact_dedup", "minhash_dedup", "minhash_index")
# datatrove's MinHash as FineWeb runs it (datatrove.pipeline.dedup.minhash.MinhashConfig defaults)
DATATROVE_MINHASH = {"n_grams": 5, "num_buckets": 14, "hashes_per_bucket": 8, "seed": 1}
# Crucible's curate.dedup.minhash settings the benchmark reports (it runs Crucible's defaults)
_CRUCIBLE_MINHASH_KEYS = ("ngram", "bands", "rows", "seed", "scheme", "hash", "verify", "verify_threshold",
                          "representative_threshold", "survivor")
# Crucible run with datatrove's LSH (the recall runs' third side, `crucible_fineweb_lsh`): 14 x 8, no
# exact-Jaccard check, every LSH component keeps one document; what Crucible's defaults gain over it,
# and what their verification costs, on the same corpora
CRUCIBLE_FINEWEB_LSH = {"ngram": DATATROVE_MINHASH["n_grams"], "bands": DATATROVE_MINHASH["num_buckets"],
                        "rows": DATATROVE_MINHASH["hashes_per_bucket"], "seed": DATATROVE_MINHASH["seed"],
                        "verify": False, "representative_threshold": 0.0, "survivor": "first_seen"}


def crucible_minhash() -> dict:
    """Crucible's default `curate.dedup.minhash` (what the main run and the recall runs use)."""
    from tasks.config import MinHashConfig

    d = MinHashConfig().model_dump()
    return {k: d[k] for k in _CRUCIBLE_MINHASH_KEYS}
SHINGLING_DIFFERENCES = [
    "normalisation: both lower-case, strip diacritics (NFD, combining marks dropped), turn punctuation into "
    "spaces and collapse whitespace; datatrove replaces a number with its decimal separator ('1,000.5') by one "
    "'0' before removing punctuation and removes a fixed punctuation list (ASCII punctuation, some CJK and "
    "typographic marks, control chars), so characters outside it (e.g. U+2018 left quote, section, copyright, "
    "degree signs) stay inside words; Crucible maps every Unicode P*/S*/C* char to a space and each digit to "
    "'0', then a run of 0s to one '0' ('1,000.5' -> '0 0 0' vs datatrove '0')",
    "words: datatrove splits the simplified text with its English word tokenizer (spaCy rules: 'cannot' -> "
    "'can not', 'gonna' -> 'gon na'); Crucible splits on whitespace",
    "short documents: under 5 words datatrove has no shingle, Crucible one (the whole text); none here "
    "(~3.6 KB documents)",
    "hash: datatrove xxhash64 of the shingle string, 64-bit (a*h + b) mod 2^61-1 with a, b drawn by "
    "RandomState(1) as all a then all b; Crucible its default 'fast' 32-bit shingle hash (word hashes "
    "combined) and datasketch's 'affine32' permutations. Neither is biased: over 300 hash seeds x 4 corpora "
    "(1,181 planted pairs, 14 x 8) Crucible's candidate rate was 0.7155 against the exact expectation "
    "0.7158 from each pair's Jaccard (-0.0003 +- 0.0008 SE), its per-value agreement equal to the Jaccard "
    "(+0.00000 +- 0.00007), as a 64-bit hash with 'affine64' (-0.0001 +- 0.0007); `hash_draws` repeats the "
    "check for both tools on each run: the planted pairs' Jaccard under each side's shingling and their "
    "candidate rate under each side's signature code over several hash seeds",
]

CRUCIBLE_CHILD = r"""
import json, sys, time
from pathlib import Path
t_start = float(sys.argv[2])
from tasks.config import PipelineConfig
from tasks.ingest import run_ingest
from tasks.curate import run_curate
spec = json.loads(Path(sys.argv[1]).read_text())
cfg = PipelineConfig.model_validate(spec["cfg"])
t_imported = time.time()
ing = run_ingest(cfg, Path(spec["out"]) / "ingest")
t_ingested = time.time()
cur = run_curate(cfg, [Path(p) for p in ing["shards"]], Path(spec["out"]) / "curate")
t_end = time.time()
print("RESULT " + json.dumps({"startup_s": round(t_imported - t_start, 3), "ingest_s": round(t_ingested - t_imported, 3),
      "curate_s": round(t_end - t_ingested, 3), "ingest": {k: ing[k] for k in ("docs_in", "docs_out", "seconds")},
      "curate": {**{k: cur[k] for k in ("docs_in", "docs_out", "dropped", "steps", "timings", "seconds", "dropped_file",
                                         "shards")}, "dedup": {"clustering": (cur.get("dedup") or {}).get("clustering")}}}))
"""


# ------------------------------------------------------------------ datatrove's side (its own process)

def datatrove_process(spec_path: str) -> None:
    """datatrove's FineWeb-style pipeline: filters + signatures, buckets, clusters, filter."""
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup import (MinhashDedupBuckets, MinhashDedupCluster, MinhashDedupFilter,
                                          MinhashDedupSignature)
    from datatrove.pipeline.dedup.minhash import MinhashConfig
    from datatrove.pipeline.filters import LanguageFilter
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers import JsonlWriter
    from datatrove.utils.lid import FT176LID
    from filters_vs_datatrove import datatrove_chain

    spec = json.loads(Path(spec_path).read_text())
    out, tasks, workers = spec["out"], spec["tasks"], spec["workers"]

    class LocalFT176(FT176LID):
        """datatrove's fastText LID, its model read from a local file (no download, no lock)."""

        @property
        def model(self):
            if self._model is None:
                from fasttext.FastText import _FastText

                self._model = _FastText(spec["lid_model"])
            return self._model

    _xxhash_takes_str()
    filters = []
    if not spec.get("minhash_only"):  # the recall runs: MinHash dedup alone, every document in
        LanguageFilter._requires_dependencies = [("fasttext", "fasttext-numpy2-wheel")]  # fasteners: download lock only
        lid = LanguageFilter(languages=list(spec["languages"]), language_threshold=spec["languages"]["en"],
                             exclusion_writer=JsonlWriter(f"{out}/excluded/langid", compression=None))
        lid.model = LocalFT176(lid.languages)
        filters = [lid, *datatrove_chain(spec["sections"],
                                         lambda name: JsonlWriter(f"{out}/excluded/{name}", compression=None))]
    mh = MinhashConfig(n_grams=spec["minhash"]["ngram"], num_buckets=spec["minhash"]["bands"],
                       hashes_per_bucket=spec["minhash"]["rows"], seed=spec["minhash"]["seed"])
    run = dict(start_method="fork")
    LocalPipelineExecutor(pipeline=[JsonlReader(spec["input"]), *filters,
                                    JsonlWriter(f"{out}/filtered", compression=None),
                                    MinhashDedupSignature(output_folder=f"{out}/sigs", config=mh)],
                          tasks=tasks, workers=workers, **run, **_logs(out, "1")).run()
    LocalPipelineExecutor(pipeline=[MinhashDedupBuckets(input_folder=f"{out}/sigs", output_folder=f"{out}/buckets",
                                                        config=mh)],
                          tasks=mh.num_buckets, workers=workers, **run, **_logs(out, "2")).run()
    LocalPipelineExecutor(pipeline=[MinhashDedupCluster(input_folder=f"{out}/buckets", output_folder=f"{out}/remove",
                                                        config=mh)],
                          tasks=1, workers=1, **run, **_logs(out, "3")).run()
    LocalPipelineExecutor(pipeline=[JsonlReader(f"{out}/filtered"),
                                    MinhashDedupFilter(input_folder=f"{out}/remove",
                                                       exclusion_writer=JsonlWriter(f"{out}/excluded/minhash",
                                                                                    compression=None)),
                                    JsonlWriter(f"{out}/kept", compression=None)],
                          tasks=tasks, workers=workers, **run, **_logs(out, "4")).run()


def _xxhash_takes_str() -> None:
    """datatrove 0.10.1 hashes shingles as str; xxhash 4 takes bytes only: encode as UTF-8 first
    (what xxhash < 4 did itself). Set before the pool forks, so its workers have it too."""
    import types

    import xxhash
    from datatrove.utils.hashes import xxhash as dt_xxhash

    def utf8(fn):
        return lambda data: fn(data.encode("utf-8") if isinstance(data, str) else data)
    dt_xxhash.xxhash = types.SimpleNamespace(xxh32_intdigest=utf8(xxhash.xxh32_intdigest),
                                             xxh64_intdigest=utf8(xxhash.xxh64_intdigest))


def _logs(out: str, stage: str) -> dict:
    return {"logging_dir": f"{out}/logs/{stage}"}


def _ids(folder: Path) -> list[str]:
    return [json.loads(line)["id"] for f in sorted(folder.glob("*.jsonl")) for line in f.open()]


def datatrove_outcome(out: Path) -> tuple[dict[str, str | None], set[str], set[str]]:
    """Filter decision per id (None: passed every filter, else the filter), the ids that passed the
    filters, the ids in the final output."""
    decisions: dict[str, str | None] = {i: None for i in _ids(out / "filtered")}
    for name in _FILTERS:
        for i in _ids(out / "excluded" / name) if (out / "excluded" / name).is_dir() else []:
            decisions[i] = name
    return decisions, set(_ids(out / "filtered")), set(_ids(out / "kept"))


# ------------------------------------------------------------------ Crucible's side

def crucible_config(files_glob: str, minhash_only: bool = False, minhash: dict | None = None) -> dict:
    """The default curate config (every step on) over the JSONL files, 2 Ray CPUs, no resume;
    `minhash_only`: every step off but MinHash dedup (the recall runs); `minhash`: settings of
    `curate.dedup.minhash` instead of its defaults (the recall runs' `crucible_fineweb_lsh` side)."""
    curate: dict = {"resume": False, "dedup": {"minhash": dict(minhash or {})}}
    if minhash_only:
        curate.update({name: {"enabled": False} for name in ("langid", *_FILTERS[1:], "decontam", "pii")})
        curate["dedup"].update(exact=False, url={"enabled": False}, lines={"enabled": False})
    return {"name": "curate-vs-datatrove", "ray": {"num_cpus": WORKERS},
            "sources": [{"name": "bench", "uri": files_glob, "format": "jsonl", "licence": "public domain",
                         "provenance": "shared/data/text/gutenberg via benchmarks/curate_scale.py"}],
            "ingest": {"resume": False},
            "curate": curate}


def crucible_outcome(res: dict, id_of: dict[str, str]) -> tuple[dict[str, str | None], set[str], set[str], Counter]:
    """Like `datatrove_outcome`, from Crucible's dropped.jsonl (ids mapped back to the corpus's);
    also the drops by Crucible's own extra steps (line dedup, decontamination), apart."""
    back = {v: k for k, v in id_of.items()}
    step_of: dict[str, str] = {}
    reason_of: dict[str, str] = {}
    for line in open(res["curate"]["dropped_file"]):
        d = json.loads(line)
        step_of[back[d["id"]]], reason_of[back[d["id"]]] = d["step"], d["reason"]
    decisions: dict[str, str | None] = {}
    passed, kept, extra = set(), set(), Counter()
    for i in id_of:
        step = step_of.get(i)
        if step in _FILTERS:
            decisions[i] = step
        elif step is not None and step not in _DEDUP_STEPS:
            extra[f"{step}:{reason_of[i]}"] += 1
        else:
            decisions[i] = None
            passed.add(i)
            if step is None:
                kept.add(i)
    return decisions, passed, kept, extra


# ------------------------------------------------------------------ comparison

def dup_groups(origins: dict[str, tuple[str, str]]) -> dict[str, list[str]]:
    """Root original → its copies (a copy of a copy belongs to the original's group)."""
    def root(i: str) -> str:
        while i in origins:
            i = origins[i][0]
        return i
    groups: dict[str, list[str]] = {}
    for c in origins:
        groups.setdefault(root(c), [root(c)]).append(c)
    return groups


def dedup_quality(groups: dict[str, list[str]], passed: set[str], kept: set[str]) -> dict:
    """Recall: of the redundant members that passed the filters (per group, all but one), the share the
    dedup removed. False drops: documents the dedup removed though no other member of their group
    (or none at all: not a generated copy) passed the filters."""
    in_group = {m: g for g, members in groups.items() for m in members}
    to_remove = removed = 0
    for members in groups.values():
        f = sum(m in passed for m in members)
        o = sum(m in kept for m in members)
        if f >= 2:
            to_remove += f - 1
            removed += f - max(o, 1)
    false_drops = 0
    for i in passed - kept:
        g = in_group.get(i)
        if g is None or sum(m in passed for m in groups[g]) < 2:
            false_drops += 1
    return {"duplicates_to_remove": to_remove, "removed": removed,
            "recall": round(removed / to_remove, 4) if to_remove else None, "false_drops": false_drops}


def agreement(ids: list[str], ours: dict, theirs: dict, show: int = 20) -> dict:
    both = [i for i in ids if i in ours and i in theirs]
    disagree = [i for i in both if (ours[i] is None) != (theirs[i] is None)]
    return {"compared": len(both), "keep_drop_agreement": round(1 - len(disagree) / len(both), 5) if both else None,
            "same_step": round(sum(ours[i] == theirs[i] for i in both) / len(both), 5) if both else None,
            "disagreements": len(disagree),
            "disagreement_pairs": dict(Counter(f"{ours[i] or 'keep'} | {theirs[i] or 'keep'}"
                                               for i in disagree).most_common()),
            "disagreeing_ids": disagree[:show],
            "crucible_filter_drops": dict(Counter(v for i, v in ours.items() if v).most_common()),
            "datatrove_filter_drops": dict(Counter(v for i, v in theirs.items() if v).most_common())}


def crucible_steps(res: dict) -> dict:
    """Where Crucible's time goes: wall seconds of the process's phases, and CPU seconds per filter step
    in the map (summed over the 2 workers)."""
    t = res["curate"]["timings"]
    return {"startup_wall_s": res["startup_s"], "ingest_wall_s": res["ingest_s"], "curate_wall_s": res["curate_s"],
            "curate_phases_wall_s": {k: t.get(k) for k in ("decontam_index_s", "line_counts_s", "map_s", "dedup_s",
                                                           "write_s")},
            "map_docs_per_s": t.get("map_docs_per_s"),
            "map_step_cpu_s": {s["name"]: s["seconds"] for s in res["curate"]["steps"]}}


# ------------------------------------------------------------------ running

def _timed(cmd: list[str], log: Path, env: dict | None = None) -> tuple[float, float, str]:
    """Run `cmd`: wall seconds, CPU seconds (user + system) of its whole process tree (Ray's
    processes, datatrove's pool; `tasks.core.energy.ProcessTree`, sampled every 0.2 s), stdout."""
    import threading

    from tasks.core.energy import ProcessTree

    tree, stop = ProcessTree(), threading.Event()
    tree.start()

    def sample() -> None:
        while not stop.wait(0.2):
            tree.sample()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    stop.set()
    sampler.join()
    tree.sample()
    cpu = tree.cpu_seconds() - (tree.own - tree.own0)  # this process's own time is not the child's
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        sys.exit(f"{cmd[:3]} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    return wall, cpu, proc.stdout


def write_files(docs: list[dict], folder: Path, parts: int) -> None:
    folder.mkdir(parents=True)
    step = -(-len(docs) // parts)
    for k in range(parts):
        with (folder / f"part-{k:05d}.jsonl").open("w", encoding="utf-8") as f:
            for d in docs[k * step:(k + 1) * step]:
                f.write(json.dumps({"id": d["id"], "text": d["text"]}, ensure_ascii=False) + "\n")


def run_datatrove(work: Path, inp: Path, minhash_only: bool = False) -> tuple[float, float]:
    from tasks.config import CurateConfig
    from tasks.curate.langid import lid_model_path
    from filters_vs_datatrove import _DT_NAMES

    cur = CurateConfig()
    spec = work / "datatrove.spec.json"
    spec.write_text(json.dumps({
        "input": str(inp), "out": str(work / "dt"), "tasks": FILES, "workers": WORKERS, "minhash_only": minhash_only,
        "lid_model": str(lid_model_path()), "languages": cur.langid.languages,
        "sections": cur.model_dump(include=set(_DT_NAMES)),
        "minhash": {"ngram": DATATROVE_MINHASH["n_grams"], "bands": DATATROVE_MINHASH["num_buckets"],
                    "rows": DATATROVE_MINHASH["hashes_per_bucket"], "seed": DATATROVE_MINHASH["seed"]}}))
    wall, cpu, _ = _timed([sys.executable, str(Path(__file__).resolve()), "--datatrove-process", str(spec)],
                          work / "datatrove.log")
    return wall, cpu


def run_crucible(work: Path, inp: Path, minhash_only: bool = False,
                 minhash: dict | None = None) -> tuple[float, float, dict]:
    spec = work / "crucible.spec.json"
    spec.write_text(json.dumps({"cfg": crucible_config(str(inp / "*.jsonl"), minhash_only, minhash),
                                "out": str(work / "crucible")}))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    wall, cpu, stdout = _timed([sys.executable, "-c", CRUCIBLE_CHILD, str(spec), repr(time.time())],
                               work / "crucible.log", env)
    line = next(x for x in stdout.splitlines() if x.startswith("RESULT "))
    return wall, cpu, json.loads(line[7:])


RECALL_SIDES = ("crucible", "datatrove", "crucible_fineweb_lsh")


def recall_runs(n: int, seeds: list[int], work: Path) -> dict:
    """Near-duplicate recall and false drops of each side's MinHash dedup alone (its own code path:
    datatrove's signature/buckets/cluster/filter steps, Crucible's curate stage with every other step
    off and its default MinHash settings; and Crucible with datatrove's LSH, `CRUCIBLE_FINEWEB_LSH`)
    on corpora of `seeds`, every document in: one corpus's recall varies by chance (~0.02 over ~300
    copies), so the comparison is of means over the corpora, with standard errors (of each mean and
    of the paired per-corpus difference). Crucible's two runs also give the wall / CPU seconds
    and the clustering stats (candidate and verified pairs) the verification costs."""
    from curate_scale import corpus
    from tasks.core.documents import make_doc_id

    per_seed = []
    for seed in seeds:
        origins: dict[str, tuple[str, str]] = {}
        docs = corpus(n, seed=seed, origins=origins)
        run_dir = work / f"recall-{seed}"
        inp = run_dir / "input"
        write_files(docs, inp, FILES)
        ids = {d["id"] for d in docs}
        groups = dup_groups(origins)
        row: dict = {"seed": seed}
        run_datatrove(run_dir, inp, minhash_only=True)
        row["datatrove"] = dedup_quality(groups, ids, datatrove_outcome(run_dir / "dt")[2])
        for side, mh in (("crucible", None), ("crucible_fineweb_lsh", CRUCIBLE_FINEWEB_LSH)):
            wall, cpu, cr = run_crucible(run_dir, inp, minhash_only=True, minhash=mh)
            kept = crucible_outcome(cr, {i: make_doc_id("bench", i) for i in ids})[2]
            row[side] = {**dedup_quality(groups, ids, kept), "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
                         "dedup_wall_s": cr["curate"]["timings"].get("dedup_s"),
                         "clustering": _clustering_counts(cr)}
            shutil.rmtree(run_dir / "crucible", ignore_errors=True)
        per_seed.append(row)
        print(f"  recall seed {seed}: " + ", ".join(f"{s_} {row[s_]['recall']} ({row[s_]['false_drops']} false drops)"
                                                   for s_ in RECALL_SIDES), file=sys.stderr, flush=True)
        shutil.rmtree(run_dir, ignore_errors=True)
    return {"documents": n, "seeds": seeds, "per_seed": per_seed, **recall_summary(per_seed)}


def _clustering_counts(res: dict) -> dict:
    """The MinHash clustering's pair counts from a curate result's dedup report (None where absent)."""
    c = (res["curate"].get("dedup") or {}).get("clustering") or {}
    return {k: c.get(k) for k in ("candidate_pairs", "verified_pairs", "method")}


def mean_se(xs: list[float]) -> tuple[float, float | None]:
    """Mean and its standard error (sample standard deviation / sqrt(n); None for one value)."""
    import statistics

    m = statistics.fmean(xs)
    return m, (statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else None)


def recall_summary(per_seed: list[dict]) -> dict:
    """Per side the mean recall and false drops over the corpora with their standard errors, and the
    paired per-corpus differences Crucible - datatrove (recall, false drops) with theirs."""
    def r4(x):
        return None if x is None else round(x, 4)
    out: dict = {"mean_recall": {}, "recall_se": {}, "mean_false_drops": {}, "false_drops_se": {}}
    for side in RECALL_SIDES:
        if not all(side in r for r in per_seed):
            continue
        m, se = mean_se([r[side]["recall"] for r in per_seed])
        out["mean_recall"][side], out["recall_se"][side] = r4(m), r4(se)
        m, se = mean_se([r[side]["false_drops"] for r in per_seed])
        out["mean_false_drops"][side], out["false_drops_se"][side] = r4(m), r4(se)
    for key, field_ in (("recall_difference", "recall"), ("false_drops_difference", "false_drops")):
        m, se = mean_se([r["crucible"][field_] - r["datatrove"][field_] for r in per_seed])
        out[key] = {"crucible_minus_datatrove": r4(m), "se": r4(se)}
    runs = [r for r in per_seed if "cpu_s" in r.get("crucible_fineweb_lsh", {})]
    if runs:  # Crucible's defaults (verified 28 x 4) vs datatrove's LSH in Crucible: the verification's cost
        out["crucible_defaults_vs_fineweb_lsh_cost"] = {
            k: {"mean": r4(mean_se(d)[0]), "se": r4(mean_se(d)[1])}
            for k, d in (("wall_s", [r["crucible"]["wall_s"] - r["crucible_fineweb_lsh"]["wall_s"] for r in runs]),
                         ("cpu_s", [r["crucible"]["cpu_s"] - r["crucible_fineweb_lsh"]["cpu_s"] for r in runs]),
                         ("dedup_wall_s", [(r["crucible"]["dedup_wall_s"] or 0) - (r["crucible_fineweb_lsh"]
                                                                                   ["dedup_wall_s"] or 0)
                                           for r in runs]))}
    return out


def _corpus_draws(texts: list[str], a, b, draws: int, sig_dir: Path, rates: dict, jac: dict, excess: dict,
                  bias_draws: int = 0) -> None:
    """`hash_draws` on one corpus: appends the pairs (a[k], b[k]) of `texts`' Jaccards to `jac`,
    each hash seed's candidate rate to `rates` and its excess over the exact expectation (the mean
    over the pairs of 1-(1-s^rows)^bands at each pair's own Jaccard s) to `excess`, per side; and
    Crucible's excess for seeds 1..`bias_draws` to `excess["crucible_bias"]` (its signatures are
    cheap: enough seeds to see a bias of a few thousandths)."""
    import numpy as np
    from datatrove.pipeline.dedup.minhash import MinhashConfig, MinhashDedupSignature

    from tasks.dedup.minhash import MinHasher, simplified_words

    n_gram, bands, rows = (CRUCIBLE_FINEWEB_LSH[k] for k in ("ngram", "bands", "rows"))
    dt_sig = MinhashDedupSignature(output_folder=str(sig_dir), config=MinhashConfig(
        n_grams=n_gram, num_buckets=bands, hashes_per_bucket=rows, seed=1))
    dt_shingles = [dt_sig.get_shingles(t) for t in texts]
    words = [simplified_words(t) for t in texts]
    cr_sets = [{" ".join(w[i:i + n_gram]) for i in range(len(w) - n_gram + 1)} for w in words]
    dt_sets = [set(x.ravel().tolist()) for x in dt_shingles]
    expected = {}
    for side, sets in (("crucible", cr_sets), ("datatrove", dt_sets)):
        j = np.array([len(sets[x] & sets[y]) / len(sets[x] | sets[y]) for x, y in zip(a, b)])
        jac[side] += j.tolist()
        expected[side] = float((1 - (1 - j ** rows) ** bands).mean())

    def candidates(sigs) -> float:
        s = np.asarray(sigs).reshape(len(sigs), bands, rows)
        return float((s[a] == s[b]).all(axis=2).any(axis=1).mean())
    for seed in range(1, draws + 1):
        rates["crucible"].append(candidates(MinHasher(bands, rows, seed, n_gram).signatures_from_words(words)))
        dt_sig.config.seed, dt_sig._parameters = seed, None
        rates["datatrove"].append(candidates([np.concatenate(dt_sig.get_signature(x)) for x in dt_shingles]))
        for side in rates:
            excess[side].append(rates[side][-1] - expected[side])
    for seed in range(1, bias_draws + 1):
        got = candidates(MinHasher(bands, rows, seed, n_gram).signatures_from_words(words))
        excess["crucible_bias"].append(got - expected["crucible"])


def hash_draws(n: int, corpus_seeds: list[int], draws: int, work: Path, bias_draws: int = 0) -> dict:
    """Why the two recalls differ: over the planted near copies (copy, original) of the recall
    corpora, each pair's shingle Jaccard under each side's own shingling, and the share of pairs
    that become LSH candidates (share a band) under each side's own signature code (datatrove's
    `MinhashDedupSignature`, Crucible's `MinHasher`, both with datatrove's 14 x 8 banding,
    `CRUCIBLE_FINEWEB_LSH`) for hash seeds 1..`draws` (the same seeds both sides), and its excess
    over the exact expectation from each pair's own Jaccard. Equal Jaccards and an excess within
    its standard error on both sides mean neither hash family is biased: a recall gap at the same
    banding is the luck of the draw (seed 1), not a difference in method; the standard error says
    how large such luck runs. datatrove's signature step gets a folder under `work`, removed after
    each corpus."""
    import numpy as np

    from curate_scale import corpus

    _xxhash_takes_str()
    bands, rows = CRUCIBLE_FINEWEB_LSH["bands"], CRUCIBLE_FINEWEB_LSH["rows"]
    rates: dict[str, list[float]] = {"crucible": [], "datatrove": []}
    jac: dict[str, list[float]] = {"crucible": [], "datatrove": []}
    excess: dict[str, list[float]] = {"crucible": [], "datatrove": [], "crucible_bias": []}
    for cseed in corpus_seeds:
        origins: dict[str, tuple[str, str]] = {}
        docs = corpus(n, seed=cseed, origins=origins)
        at = {d["id"]: i for i, d in enumerate(docs)}
        pairs = [(at[c], at[o]) for c, (o, kind) in origins.items() if kind == "near"]
        need = sorted({i for p in pairs for i in p})
        row = {i: k for k, i in enumerate(need)}
        a, b = np.array([row[x] for x, _ in pairs]), np.array([row[y] for _, y in pairs])
        texts = [docs[i]["text"] for i in need]
        sig_dir = work / f"dt-sig-{cseed}"
        try:
            _corpus_draws(texts, a, b, draws, sig_dir, rates, jac, excess, bias_draws)
        finally:
            shutil.rmtree(sig_dir, ignore_errors=True)
    out: dict = {"corpora": corpus_seeds, "hash_seeds": [1, draws], "near_pairs": len(jac["crucible"]),
                 "banding": f"{bands} x {rows}"}
    for side in rates:
        r = np.array(rates[side])
        j = np.array(jac[side])
        out[side] = {"mean_jaccard": round(float(j.mean()), 4),
                     "expected_candidate_rate_from_jaccard": round(float((1 - (1 - j ** rows) ** bands).mean()), 4),
                     "candidate_rate_mean": round(float(r.mean()), 4),
                     "candidate_rate_se": round(float(r.std(ddof=1) / np.sqrt(len(r))), 4),
                     "candidate_rate_minus_expected": round(float(np.mean(excess[side])), 4),
                     "candidate_rate_minus_expected_se": round(float(np.std(excess[side], ddof=1)
                                                                     / np.sqrt(len(excess[side]))), 4),
                     "candidate_rate_seed1_per_corpus": [round(x, 4) for x in r[::draws]]}
    if excess["crucible_bias"]:
        e = np.array(excess["crucible_bias"])
        out["crucible_bias_over_seeds"] = {"hash_seeds": [1, bias_draws], "corpora": len(corpus_seeds),
                                           "candidate_rate_minus_expected": round(float(e.mean()), 4),
                                           "se": round(float(e.std(ddof=1) / np.sqrt(len(e))), 4)}
    out["pairs_with_equal_jaccard"] = round(float(np.mean(np.isclose(jac["crucible"], jac["datatrove"]))), 4)
    diff = np.array(rates["crucible"]) - np.array(rates["datatrove"])
    out["difference_mean"], out["difference_se"] = round(float(diff.mean()), 4), round(
        float(diff.std(ddof=1) / np.sqrt(len(diff))), 4)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--docs", type=int, default=3000)
    p.add_argument("--work", default=None, help="scratch directory (default: a temporary one, removed)")
    p.add_argument("--recall-seeds", type=int, default=4,
                   help="corpora (seeds 0..N-1) for the MinHash-only recall runs and `hash_draws` (0: neither)")
    p.add_argument("--hash-draws", type=int, default=8,
                   help="hash seeds per recall corpus for `hash_draws` (why recall differs; 0: skip)")
    p.add_argument("--bias-draws", type=int, default=100,
                   help="hash seeds per recall corpus for Crucible's signatures alone in `hash_draws` (bias check)")
    p.add_argument("--out", default=str(HERE / "results" / "curate_vs_datatrove.json"))
    p.add_argument("--datatrove-process", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sys.path.insert(0, str(HERE))
    if args.datatrove_process:
        datatrove_process(args.datatrove_process)
        return {}
    from importlib.util import find_spec

    if find_spec("datatrove") is None:
        sys.exit("this benchmark needs the 'bench' extra: .venv/bin/pip install -e '.[bench]'")
    from _common import code_commit, write_result
    from curate_scale import corpus
    from tasks.core.documents import make_doc_id

    origins: dict[str, tuple[str, str]] = {}
    docs = corpus(args.docs, origins=origins)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="curate-vs-datatrove-"))
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    try:
        inp = work / "input"
        write_files(docs, inp, FILES)
        print(f"{len(docs)} documents in {FILES} files; datatrove ...", file=sys.stderr, flush=True)
        load0 = os.getloadavg()
        dt_wall, dt_cpu = run_datatrove(work, inp)
        print(f"  datatrove {dt_wall:.1f} s ({dt_cpu:.1f} CPU s); crucible ...", file=sys.stderr, flush=True)
        cr_wall, cr_cpu, cr = run_crucible(work, inp)
        print(f"  crucible {cr_wall:.1f} s ({cr_cpu:.1f} CPU s)", file=sys.stderr, flush=True)
        load1 = os.getloadavg()
        ids = [d["id"] for d in docs]
        dt_dec, dt_passed, dt_kept = datatrove_outcome(work / "dt")
        cr_dec, cr_passed, cr_kept, extra = crucible_outcome(cr, {i: make_doc_id("bench", i) for i in ids})
        recall = recall_runs(len(docs), list(range(args.recall_seeds)), work) if args.recall_seeds else None
        # on the recall corpora, as documented: none with --recall-seeds 0
        draws = hash_draws(len(docs), list(range(args.recall_seeds)), args.hash_draws, work, args.bias_draws) \
            if args.hash_draws and args.recall_seeds else None
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    result = report(len(docs), origins, (dt_wall, dt_cpu), (cr_wall, cr_cpu), cr, (dt_dec, dt_passed, dt_kept),
                    (cr_dec, cr_passed, cr_kept, extra), ids, recall)
    result["machine"]["load_avg_before"], result["machine"]["load_avg_after_main_runs"] = load0, load1
    result["code_commit"] = code_commit(REPO)
    result["near_dup_candidates_over_hash_draws"] = draws
    if draws:
        print(f"near-pair candidate rate over {args.hash_draws} hash seeds x {len(draws['corpora'])} corpora: "
              f"crucible {draws['crucible']['candidate_rate_mean']} vs datatrove "
              f"{draws['datatrove']['candidate_rate_mean']} (difference {draws['difference_mean']} +- "
              f"{draws['difference_se']} SE); Jaccard equal on {draws['pairs_with_equal_jaccard']:.1%} of pairs")
        if "crucible_bias_over_seeds" in draws:
            b = draws["crucible_bias_over_seeds"]
            print(f"crucible candidate rate minus the exact expectation over {args.bias_draws} hash seeds: "
                  f"{b['candidate_rate_minus_expected']} +- {b['se']} SE")
    write_result(args.out, result, indent=1)
    print(f"wrote {args.out}")
    return result


def report(n, origins, dt_time, cr_time, cr, dt, crs, ids, recall: dict | None = None) -> dict:
    """The JSON: each side's wall and CPU seconds (whole process tree), the wall-clock speed-up
    (the target) and the CPU one (steadier on a loaded machine), agreement, near-dup quality of
    the main run and, with `recall`, the MinHash-only runs' mean recall (the recall target)."""
    from importlib.metadata import version

    (dt_wall, dt_cpu), (cr_wall, cr_cpu) = dt_time, cr_time
    groups = dup_groups(origins)
    speedup = round(dt_wall / cr_wall, 2)
    agree = agreement(ids, crs[0], dt[0])
    dq_dt, dq_cr = dedup_quality(groups, dt[1], dt[2]), dedup_quality(groups, crs[1], crs[2])
    result = {
        "documents": n, "input_files": FILES, "workers": WORKERS,
        "corpus": {"generator": "benchmarks/curate_scale.py corpus(seed 0)",
                   "near_duplicates": sum(k == "near" for _, k in origins.values()),
                   "exact_copies": sum(k == "exact" for _, k in origins.values()), "duplicate_groups": len(groups)},
        "machine": {"cores_usable": len(os.sched_getaffinity(0)), "load_avg_at_end": os.getloadavg()},
        "datatrove_version": version("datatrove"),
        "datatrove": {"wall_s": round(dt_wall, 2), "cpu_s": round(dt_cpu, 2), "docs_per_s": round(n / dt_wall, 2),
                      "passed_filters": len(dt[1]), "kept": len(dt[2]), "near_dup": dq_dt},
        "crucible": {"wall_s": round(cr_wall, 2), "cpu_s": round(cr_cpu, 2), "docs_per_s": round(n / cr_wall, 2),
                     "passed_filters": len(crs[1]), "kept": len(crs[2]),
                     "kept_reported": cr["curate"]["docs_out"], "dropped": cr["curate"]["dropped"],
                     "dropped_by_own_extra_steps": dict(crs[3]), "near_dup": dq_cr, "time": crucible_steps(cr)},
        "minhash_settings": {
            "datatrove": {**DATATROVE_MINHASH, "shingle": "word n-grams of simplify_text (TextNormConfig defaults)",
                          "hash_config": "precision 64, xxhash", "rule": "LSH connected component keeps one"},
            "crucible": {**crucible_minhash(), "shingle": "word n-grams of tasks.dedup.minhash.simplify",
                         "rule": "a candidate pair (one of the bands equal) is joined only if its exact shingle "
                                 "Jaccard >= verify_threshold; a component member is dropped only if its exact "
                                 "Jaccard to the kept document >= representative_threshold (the others re-clustered)"},
            "crucible_fineweb_lsh": {**CRUCIBLE_FINEWEB_LSH, "runs": "the recall runs' third side only",
                                     "rule": "LSH connected component keeps one"},
            "shingling_differences": SHINGLING_DIFFERENCES},
        "speedup": speedup,
        "cpu_speedup": round(dt_cpu / cr_cpu, 2),
        "filter_agreement": agree,
        "near_dup_recall_minhash_only": recall,
        "targets": targets(speedup, agree["keep_drop_agreement"], recall, dq_cr, dq_dt),
    }
    result["within_target"] = all(t["pass"] for t in result["targets"].values())
    print(f"{n} docs: datatrove {dt_wall:.1f} s ({n / dt_wall:.1f} docs/s, {len(dt[2])} kept), crucible "
          f"{cr_wall:.1f} s ({n / cr_wall:.1f} docs/s, {len(crs[2])} kept) -> {speedup}x (CPU s {dt_cpu:.1f} vs "
          f"{cr_cpu:.1f}: {result['cpu_speedup']}x); agreement "
          f"{agree['keep_drop_agreement']}; near-dup recall crucible {dq_cr['recall']} vs datatrove {dq_dt['recall']}")
    for name, t in result["targets"].items():
        print(f"  {name}: {t['value']} (target {t['target']}) {'PASS' if t['pass'] else 'FAIL'}")
    return result


def targets(speedup: float, agreement_: float | None, recall: dict | None, run_cr: dict, run_dt: dict) -> dict:
    """Issue 26 req 6's targets, each with its value and pass/fail. Near-duplicate recall: the mean over
    the corpora of each side's MinHash alone (`recall_runs`; without them, the main run's), with the
    paired difference's standard error beside it, and the main run's (the whole pipeline, what a user
    gets); each beside a precision check: the dedup's false drops (documents removed that are no
    planted copy) no more than datatrove's."""
    out = {"speedup": {"target": f">= {TARGET_SPEEDUP}", "value": speedup, "pass": speedup >= TARGET_SPEEDUP},
           "keep_drop_agreement": {"target": f">= {TARGET_AGREEMENT}", "value": agreement_,
                                   "pass": (agreement_ or 0) >= TARGET_AGREEMENT}}
    if recall:
        mr, mf = recall["mean_recall"], recall["mean_false_drops"]
        d, fd = recall["recall_difference"], recall["false_drops_difference"]
        out["near_dup_recall"] = {
            "target": f"mean over {len(recall['seeds'])} corpora >= datatrove's {mr['datatrove']} "
                      f"(+- {recall['recall_se']['datatrove']} SE)",
            "value": mr["crucible"], "se": recall["recall_se"]["crucible"],
            "difference": d["crucible_minus_datatrove"], "difference_se": d["se"],
            "pass": mr["crucible"] >= mr["datatrove"]}
        out["near_dup_false_drops"] = {
            "target": f"mean over the corpora <= datatrove's {mf['datatrove']}", "value": mf["crucible"],
            "difference": fd["crucible_minus_datatrove"], "difference_se": fd["se"],
            "pass": mf["crucible"] <= mf["datatrove"]}
    elif run_cr["recall"] is not None:
        out["near_dup_recall"] = {"target": f">= datatrove's {run_dt['recall']} (one corpus)",
                                  "value": run_cr["recall"], "pass": run_cr["recall"] >= (run_dt["recall"] or 0)}
    if run_cr["recall"] is not None:
        out["near_dup_recall_whole_pipeline"] = {"target": f">= datatrove's {run_dt['recall']}",
                                                 "value": run_cr["recall"],
                                                 "pass": run_cr["recall"] >= (run_dt["recall"] or 0)}
        out["near_dup_false_drops_whole_pipeline"] = {"target": f"<= datatrove's {run_dt['false_drops']}",
                                                      "value": run_cr["false_drops"],
                                                      "pass": run_cr["false_drops"] <= run_dt["false_drops"]}
    return out


if __name__ == "__main__":
    main()
