"""Trace a node to its raw sources, and the provenance report of a model version for auditors.

Both walk the lineage *upstream* run by run (see LineageStore.walk), so they describe exactly the
runs and artifact versions that led to the node. The report uses whatever facets the events carry
and leaves a section empty (with a note) when they carry nothing for it. Recognised, besides the
standard OpenLineage facets:

- licences: the `crucible_source` dataset facet (source, licence, provenance) of raw files; the
  same facet with `derived: true` on derived artifacts (the union of their raw sources) is not a
  source itself;
- row counts: input `dataQualityMetrics` / `inputStatistics` and output `outputStatistics` rowCount,
  or `docs_in` / `docs_out` / `rows_in` / `rows_out` numbers in any custom facet;
- drop counts: a `dropped` object ({reason: count}) in any custom run, job or output-dataset facet;
- configuration: custom facets whose name contains config / params / hyperparameters, and `config`
  objects inside custom facets;
- evaluation results: custom facets whose name contains eval / metric / result, and metric keys
  (val_loss, perplexity, ...) inside custom facets.
"""
from __future__ import annotations

import json

from infra.services.lineage.fastjson import loads
import re
from datetime import datetime, timezone
from typing import Any

from infra.services.lineage.store import LineageStore, Node, node_id
from infra.services.lineage.views import Links, dataset_links, run_links, _ms

TRACE_DEPTH = 200  # job hops; deep enough for any real chain, bounded against cycles

# Facets that are plumbing rather than content, left out of the "custom facets" of a stage.
_PLUMBING = {"processing_engine", "processingEngine", "parent", "tags", "jobType", "version", "crucible_source",
             "dataQualityMetrics", "inputStatistics", "outputStatistics", "nominalTime", "errorMessage",
             "environment-properties", "crucible_links", "sourceCodeLocation", "documentation", "ownership", "schema",
             "dataSource", "symlinks", "storage", "lifecycleStateChange", "columnLineage"}
_CONFIG_NAME = re.compile(r"config|param|hyper|setting", re.IGNORECASE)
_EVAL_NAME = re.compile(r"eval|metric|result|score", re.IGNORECASE)
_EVAL_KEYS = {"val_loss", "val_perplexity", "perplexity", "loss", "accuracy", "bits_per_byte", "bpb",
              "eval_loss", "val_bpb"}
_COUNT_KEYS = {"docs_in": "docsIn", "docs_out": "docsOut", "rows_in": "rowsIn", "rows_out": "rowsOut",
               "documents_in": "docsIn", "documents_out": "docsOut"}

# Stage kinds from job names (first match wins), e.g. curate.ingest_sources, train_tokenizer.train_bpe.
STAGE_KINDS = [("ingest", ("ingest",)), ("tokenizer", ("tokenizer", "bpe")),
               ("tokens", ("tokens", "encode", "pack")), ("evaluate", ("eval",)),
               ("deploy", ("deploy", "register", "gate", "serve")), ("curate", ("curate", "filter", "dedup")),
               ("train", ("train",))]
FILTER_KINDS = {"ingest", "curate"}


def raw_source(facets: dict) -> dict | None:
    """The `crucible_source` facet of a raw file (None for derived artifacts, evaluation data and
    unlabelled data)."""
    src = facets.get("crucible_source") if isinstance(facets, dict) else None
    return src if isinstance(src, dict) and not src.get("derived") and src.get("use") != "evaluation" else None


def evaluation_data(facets: dict) -> dict | None:
    """The `crucible_source` facet of evaluation data (`use: evaluation`): benchmark files a job
    scored with, listed apart from the sources of what it made."""
    src = facets.get("crucible_source") if isinstance(facets, dict) else None
    return src if isinstance(src, dict) and src.get("use") == "evaluation" else None


def stage_kind(job_name: str, facets: dict | None = None) -> str:
    for facet in (facets or {}).values():
        if isinstance(facet, dict) and isinstance(facet.get("stage"), str):
            return facet["stage"]
    lowered = job_name.lower()
    for kind, words in STAGE_KINDS:
        if any(w in lowered for w in words):
            return kind
    return "other"


def _clean(facet: Any) -> Any:
    return {k: v for k, v in facet.items() if not k.startswith("_")} if isinstance(facet, dict) else facet


def _custom(facets: dict) -> dict:
    return {k: _clean(v) for k, v in facets.items() if k not in _PLUMBING and isinstance(v, dict)}


def _find(obj: Any, keys: set[str], depth: int = 3) -> list[tuple[str, Any]]:
    """(key, value) pairs for any of `keys` inside nested dicts, shallowest first."""
    found, level = [], [obj]
    for _ in range(depth + 1):
        nxt = []
        for o in level:
            if isinstance(o, dict):
                for k, v in o.items():
                    if k in keys:
                        found.append((k, v))
                    elif isinstance(v, dict):
                        nxt.append(v)
        level = nxt
    return found


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _sum_rows(entries: list[dict], names: tuple[str, ...]) -> int | None:
    """Sum of rowCount over entries' input/output facets; None when no entry has one."""
    total, seen = 0, False
    for e in entries:
        for name in names:
            facet = e["ioFacets"].get(name)
            value = facet.get("rowCount") if isinstance(facet, dict) else None
            if _number(value):
                total, seen = total + value, True
                break
    return total if seen else None


# ----------------------------------------------------------------------------------------------


class Provenance:
    def __init__(self, store: LineageStore, links: Links = Links()):
        self.store = store
        self.links = links

    # -- loading ----------------------------------------------------------------------------------

    def _runs(self, run_ids: list[str]) -> list[dict]:
        """Runs with job, facets and inputs/outputs (version facets merged in), oldest first."""
        store = self.store
        runs = store.rows_by_keys("runs", ("run_id",), [(r,) for r in run_ids])
        jobs = store.rows_by_keys("jobs", ("namespace", "name"),
                                  list({(r["job_namespace"], r["job_name"]) for r in runs.values()}))
        io_rows = []
        for i in range(0, len(run_ids), 300):
            chunk = run_ids[i:i + 300]
            io_rows += store.query(f"SELECT * FROM run_io WHERE run_id IN ({', '.join('?' * len(chunk))})"
                                   " ORDER BY namespace, name", chunk)
        versions = store.rows_by_keys("dataset_versions", ("namespace", "name", "version"),
                                      list({(r["namespace"], r["name"], r["version"]) for r in io_rows if r["version"]}))
        datasets = store.rows_by_keys("datasets", ("namespace", "name"),
                                      list({(r["namespace"], r["name"]) for r in io_rows}))
        out: dict[str, dict] = {}
        for (run_id,), row in runs.items():
            job = jobs.get((row["job_namespace"], row["job_name"]))
            job_facets = loads(job["facets"]) if job is not None else {}
            run_facets = loads(row["facets"])
            job_type = job["job_type"] if job is not None else None
            out[run_id] = {
                "runId": run_id, "job": row["job_name"], "jobNamespace": row["job_namespace"],
                "jobId": node_id("JOB", row["job_namespace"], row["job_name"]), "jobType": job_type,
                "state": row["state"], "startedAt": row["started_at"], "endedAt": row["ended_at"],
                "durationMs": _ms(row["started_at"], row["ended_at"]), "parentRunId": row["parent_run_id"],
                "rootRunId": row["root_run_id"], "runFacets": run_facets, "jobFacets": job_facets,
                "inputs": [], "outputs": [], "links": run_links(run_id, job_type, run_facets, self.links)}
        for r in io_rows:
            key = (r["namespace"], r["name"])
            v = versions.get(key + (r["version"],))
            d = datasets.get(key)
            facets = loads(v["facets"]) if v is not None else (loads(d["facets"]) if d is not None else {})
            out[r["run_id"]]["inputs" if r["direction"] == "in" else "outputs"].append({
                "nodeId": node_id("DATASET", *key), "namespace": r["namespace"], "name": r["name"],
                "version": r["version"] or None, "facets": facets, "ioFacets": loads(r["facets"])})
        return sorted(out.values(), key=lambda r: (r["startedAt"] or r["endedAt"] or "", r["job"]))

    def _node(self, node_id_value: str) -> Node:
        node = self.store.resolve(node_id_value)
        if not self.store.exists(node):
            raise LookupError(f"no such node: {node_id_value}")
        return node

    # -- trace ------------------------------------------------------------------------------------

    def trace(self, node_id_value: str, depth: int = TRACE_DEPTH) -> dict:
        """All upstream raw sources of a node with their licences.

        A source is an upstream dataset with a `crucible_source` facet, or one that no run in the
        store produced (a root); roots without a licence facet are listed as unlicensed."""
        node = self._node(node_id_value)
        walk = self.store.walk(node, depth, "upstream")
        runs = self._runs(sorted(walk.runs))
        return self._trace_from(node, walk, runs)

    def _trace_from(self, node: Node, walk, runs: list[dict]) -> dict:
        produced = {o["nodeId"] for r in runs for o in r["outputs"]}
        # inputs nobody in the walk produced: roots, unless a run beyond the depth limit produced them
        unseen = {(i["namespace"], i["name"]) for r in runs for i in r["inputs"]
                  if i["nodeId"] not in produced and raw_source(i["facets"]) is None
                  and evaluation_data(i["facets"]) is None}
        beyond = {node_id("DATASET", namespace, name)
                  for _, namespace, name, *_ in self.store._io_for_datasets("out", sorted(unseen))} if unseen else set()
        sources: dict[tuple, dict] = {}
        evaluation: dict[tuple, dict] = {}
        for r in runs:
            for i in r["inputs"]:
                if (data := evaluation_data(i["facets"])) is not None:
                    entry = evaluation.setdefault((i["nodeId"], i["version"]), {
                        "nodeId": i["nodeId"], "namespace": i["namespace"], "name": i["name"],
                        "version": i["version"], "task": data.get("source"), "licence": data.get("licence"),
                        "provenance": data.get("provenance"), "readBy": []})
                    if r["job"] not in entry["readBy"]:
                        entry["readBy"].append(r["job"])
                    continue
                src = raw_source(i["facets"])
                if src is None and (i["nodeId"] in produced or i["nodeId"] in beyond):
                    continue
                if src is None:  # a root: a derived artifact made elsewhere still says what it carries
                    src = i["facets"].get("crucible_source")
                key = (i["nodeId"], i["version"])
                entry = sources.setdefault(key, {
                    "nodeId": i["nodeId"], "namespace": i["namespace"], "name": i["name"], "version": i["version"],
                    "source": src.get("source") if isinstance(src, dict) else None,
                    "licence": src.get("licence") if isinstance(src, dict) else None,
                    "provenance": src.get("provenance") if isinstance(src, dict) else None,
                    "derived": bool(isinstance(src, dict) and src.get("derived")),
                    "entries": [e for e in (src.get("sources") or []) if isinstance(e, dict)]
                    if isinstance(src, dict) and src.get("derived") else [],
                    "rows": None, "bytes": None, "readBy": []})
                dq = i["ioFacets"].get("dataQualityMetrics")
                if isinstance(dq, dict):
                    entry["rows"] = dq.get("rowCount", entry["rows"])
                    entry["bytes"] = dq.get("bytes", entry["bytes"])
                if r["job"] not in entry["readBy"]:
                    entry["readBy"].append(r["job"])
        ordered = sorted(sources.values(), key=lambda s: (s["source"] or "~", s["name"]))
        licences: dict[str, list[str]] = {}
        for s in ordered:
            pairs = [(e.get("licence"), e.get("source")) for e in s.pop("entries")] or [(s["licence"], s["source"])]
            for licence, label in pairs:
                if licence:
                    names = licences.setdefault(licence, [])
                    label = label or s["name"]
                    if label not in names:
                        names.append(label)
        return {"nodeId": node.id, "sources": ordered, "licences": licences,
                "unlicensed": [s["nodeId"] for s in ordered if not s["licence"]],
                "evaluationData": sorted(evaluation.values(), key=lambda e: (e["task"] or "~", e["name"])),
                "truncated": walk.truncated}

    # -- report -----------------------------------------------------------------------------------

    def report(self, node_id_value: str, depth: int = TRACE_DEPTH) -> dict:
        node = self._node(node_id_value)
        walk = self.store.walk(node, depth, "upstream")
        runs = self._runs(sorted(walk.runs))
        trace = self._trace_from(node, walk, runs)
        subject = self._subject(node, walk)
        stages = [self._stage(r) for r in runs]
        by_kind: dict[str, list[dict]] = {}
        for s in stages:
            by_kind.setdefault(s["kind"], []).append(s)
        pipeline_runs = self._pipeline_runs(runs)
        warnings = []
        if trace["unlicensed"]:
            warnings.append(f"{len(trace['unlicensed'])} upstream source(s) without a licence facet: "
                            + ", ".join(trace["unlicensed"][:10]))
        for s in stages:
            if s["state"] != "COMPLETED":
                warnings.append(f"run {s['runId']} of {s['job']} is {s['state']}")
        unversioned = sorted({a["nodeId"] for r in runs for a in r["inputs"] + r["outputs"] if not a["version"]})
        if unversioned:
            warnings.append(f"{len(unversioned)} artifact(s) without a version (content hash): "
                            + ", ".join(unversioned[:10]))
        if walk.truncated:
            warnings.append(f"lineage deeper than {depth} job hops was not followed")
        if not runs:
            warnings.append("no run in the store produced this node")
        return {
            "title": f"Provenance report: {node.namespace}:{node.name}",
            "generatedAt": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "subject": subject,
            "pipelineRuns": pipeline_runs,
            "sources": trace["sources"],
            "licences": trace["licences"],
            "evaluationData": trace["evaluationData"],
            "stages": stages,
            "filterStages": [s for s in stages if s["kind"] in FILTER_KINDS or s["dropped"]],
            "tokenizer": [self._artifact_section(s) for s in by_kind.get("tokenizer", [])],
            "training": [self._artifact_section(s) for s in by_kind.get("train", [])],
            "evaluation": [{"job": s["job"], "runId": s["runId"], "results": s["evalResults"],
                            "outputs": s["outputs"]} for s in by_kind.get("evaluate", [])],
            "artifacts": self._artifacts(runs),
            "warnings": warnings,
        }

    def _subject(self, node: Node, walk) -> dict:
        if node.type == "JOB":
            row = self.store.query("SELECT * FROM jobs WHERE namespace = ? AND name = ?", node.key)[0]
            return {"nodeId": node.id, "type": "JOB", "namespace": node.namespace, "name": node.name,
                    "facets": loads(row["facets"]), "links": []}
        row = self.store.query("SELECT * FROM datasets WHERE namespace = ? AND name = ?", node.key)[0]
        facets = loads(row["facets"])
        producers = self.store.query(
            "SELECT io.run_id, io.job_name, io.version, r.state, r.ended_at FROM run_io io JOIN runs r"
            " ON r.run_id = io.run_id WHERE io.direction = 'out' AND io.namespace = ? AND io.name = ?"
            " ORDER BY io.event_time", node.key)
        return {"nodeId": node.id, "type": "DATASET", "namespace": node.namespace, "name": node.name,
                "version": row["current_version"], "createdAt": row["created_at"], "facets": facets,
                "links": dataset_links(node.namespace, node.name, facets, self.links),
                "producedBy": [{"runId": p["run_id"], "job": p["job_name"], "version": p["version"] or None,
                                "state": p["state"], "endedAt": p["ended_at"]} for p in producers]}

    def _pipeline_runs(self, runs: list[dict]) -> list[dict]:
        ids = sorted({r["rootRunId"] for r in runs if r["rootRunId"]} | {r["parentRunId"] for r in runs
                                                                         if r["parentRunId"]})
        rows = self.store.rows_by_keys("runs", ("run_id",), [(i,) for i in ids])
        jobs = self.store.rows_by_keys("jobs", ("namespace", "name"),
                                       list({(r["job_namespace"], r["job_name"]) for r in rows.values()}))
        out = []
        for (run_id,), row in rows.items():
            job = jobs.get((row["job_namespace"], row["job_name"]))
            job_type = job["job_type"] if job is not None else None
            out.append({"runId": run_id, "job": row["job_name"], "state": row["state"],
                        "startedAt": row["started_at"], "endedAt": row["ended_at"],
                        "root": run_id in {r["rootRunId"] for r in runs},
                        "links": run_links(run_id, job_type, loads(row["facets"]), self.links)})
        return sorted(out, key=lambda r: (not r["root"], r["startedAt"] or ""))

    def _stage(self, run: dict) -> dict:
        custom_sources = [_custom(run["runFacets"]), _custom(run["jobFacets"])]
        custom_sources += [_custom(o["facets"]) for o in run["outputs"]]
        custom_sources += [_custom(o["ioFacets"]) for o in run["outputs"]]
        dropped: dict[str, float] = {}
        counts: dict[str, float] = {}
        for facets in custom_sources:
            for _, value in _find(facets, {"dropped", "dropped_by_reason", "drops"}):
                if isinstance(value, dict):
                    for reason, n in value.items():
                        if _number(n) and reason not in dropped:
                            dropped[reason] = n
            for key, value in _find(facets, set(_COUNT_KEYS)):
                if _number(value):
                    counts.setdefault(_COUNT_KEYS[key], value)
        rows_in = _sum_rows(run["inputs"], ("dataQualityMetrics", "inputStatistics"))
        rows_out = _sum_rows(run["outputs"], ("outputStatistics",))
        config: dict[str, Any] = {}
        results: dict[str, Any] = {}
        for facets in custom_sources:
            for name, facet in facets.items():
                if _CONFIG_NAME.search(name):
                    only_config = isinstance(facet, dict) and set(facet) == {"config"}
                    config[name] = facet["config"] if only_config else facet
                elif isinstance(facet, dict) and isinstance(facet.get("config"), dict):
                    config[name] = facet["config"]
                if _EVAL_NAME.search(name) and not _CONFIG_NAME.search(name):
                    results[name] = facet
                else:
                    metrics = {k: v for k, v in _find(facet, _EVAL_KEYS, depth=1) if _number(v)}
                    if metrics and run_kind_is_eval(run):
                        results.setdefault(name, metrics)
        custom = _custom(run["runFacets"])
        error = run["runFacets"].get("errorMessage")
        return {
            "kind": stage_kind(run["job"], _custom(run["runFacets"])),
            "job": run["job"], "jobId": run["jobId"], "runId": run["runId"], "state": run["state"],
            "startedAt": run["startedAt"], "endedAt": run["endedAt"], "durationMs": run["durationMs"],
            "parentRunId": run["parentRunId"],
            "inputs": [{"nodeId": i["nodeId"], "version": i["version"]} for i in run["inputs"]],
            "outputs": [{"nodeId": o["nodeId"], "version": o["version"]} for o in run["outputs"]],
            "rowsIn": counts.get("rowsIn", counts.get("docsIn", rows_in)),
            "rowsOut": counts.get("rowsOut", counts.get("docsOut", rows_out)),
            "dropped": dropped,
            "config": config,
            "evalResults": results,
            "customFacets": custom,
            "error": _clean(error) if isinstance(error, dict) else None,
            "links": run["links"],
        }

    @staticmethod
    def _artifact_section(stage: dict) -> dict:
        return {"job": stage["job"], "runId": stage["runId"], "config": stage["config"],
                "outputs": stage["outputs"], "customFacets": stage["customFacets"]}

    @staticmethod
    def _artifacts(runs: list[dict]) -> list[dict]:
        out, seen = [], set()
        for r in runs:
            for o in r["outputs"]:
                key = (o["nodeId"], o["version"])
                if key not in seen:
                    seen.add(key)
                    out.append({"nodeId": o["nodeId"], "name": o["name"], "version": o["version"],
                                "producedBy": r["job"], "runId": r["runId"]})
        return out


def run_kind_is_eval(run: dict) -> bool:
    return stage_kind(run["job"]) == "evaluate"


# ----------------------------------------------------------------------------------------------
# Markdown


def _md(value: Any) -> str:
    if value is None or value == "" or value == {} or value == []:
        return "—"
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return text.replace("|", "\\|").replace("\n", " ")


def _short(version: str | None) -> str:
    return f"`{version[:12]}`" if version else "—"


def _fmt_ms(ms: int | None) -> str:
    return "—" if ms is None else f"{ms / 1000:.1f} s"


def report_markdown(report: dict) -> str:
    s = report["subject"]
    lines = [f"# {report['title']}", "", f"Generated {report['generatedAt']} by the Crucible lineage service.", ""]
    lines += ["## Subject", "", "| field | value |", "| --- | --- |", f"| node | `{s['nodeId']}` |"]
    if s.get("version"):
        lines.append(f"| version (content hash) | `{s['version']}` |")
    if s.get("createdAt"):
        lines.append(f"| first seen | {s['createdAt']} |")
    for p in s.get("producedBy", []):
        lines.append(f"| produced by | {_md(p['job'])} run `{p['runId']}` ({_md(p['state'])}) |")
    for link in s.get("links", []):
        lines.append(f"| {_md(link['label'])} | {link['url']} |")
    lines.append("")
    if report["pipelineRuns"]:
        lines += ["## Pipeline runs", "", "| job | run | state | started | links |", "| --- | --- | --- | --- | --- |"]
        for r in report["pipelineRuns"]:
            links = " ".join(f"[{l['label']}]({l['url']})" for l in r["links"]) or "—"
            lines.append(f"| {_md(r['job'])} | `{r['runId']}` | {_md(r['state'])} | {_md(r['startedAt'])} | {links} |")
        lines.append("")
    lines += ["## Sources and licences", ""]
    if report["sources"]:
        lines += ["| source | licence | provenance | file | version | rows |", "| --- | --- | --- | --- | --- | --- |"]
        for src in report["sources"]:
            lines.append(f"| {_md(src['source'])} | {_md(src['licence'] or '**none recorded**')} | "
                         f"{_md(src['provenance'])} | `{src['name']}` | {_short(src['version'])} | {_md(src['rows'])} |")
        lines += ["", "Licences in use:", ""]
        lines += [f"- **{lic}** — {', '.join(names)}" for lic, names in report["licences"].items()] or ["- none recorded"]
    else:
        lines.append("No upstream sources found.")
    if report.get("evaluationData"):
        lines += ["", "## Evaluation data", "", "Benchmark files the evaluations scored with (not training data).", "",
                  "| task | licence | provenance | file | version |", "| --- | --- | --- | --- | --- |"]
        for d in report["evaluationData"]:
            lines.append(f"| {_md(d['task'])} | {_md(d['licence'])} | {_md(d['provenance'])} | `{d['name']}` | "
                         f"{_short(d['version'])} |")
    lines += ["", "## Stages", "", "| stage | job | run | state | duration | rows in | rows out | dropped |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for st in report["stages"]:
        dropped = sum(st["dropped"].values()) if st["dropped"] else None
        lines.append(f"| {st['kind']} | {_md(st['job'])} | `{st['runId'][:8]}` | {_md(st['state'])} | "
                     f"{_fmt_ms(st['durationMs'])} | {_md(st['rowsIn'])} | {_md(st['rowsOut'])} | {_md(dropped)} |")
    lines += ["", "## Filter stages", ""]
    if report["filterStages"]:
        for st in report["filterStages"]:
            lines.append(f"### {st['job']} (run `{st['runId']}`)")
            lines.append("")
            lines.append(f"Documents in: {_md(st['rowsIn'])}; out: {_md(st['rowsOut'])}.")
            if st["dropped"]:
                lines += ["", "| reason | dropped |", "| --- | --- |"]
                lines += [f"| {_md(k)} | {_md(v)} |" for k, v in sorted(st["dropped"].items(), key=lambda kv: -kv[1])]
            else:
                lines.append("")
                lines.append("No drop counts were recorded in this run's facets.")
            lines.append("")
    else:
        lines += ["No filter stage found upstream.", ""]
    for title, key in (("Tokenizer", "tokenizer"), ("Training", "training")):
        lines += [f"## {title}", ""]
        if not report[key]:
            lines += [f"No {title.lower()} run found upstream.", ""]
        for sec in report[key]:
            lines.append(f"Run `{sec['runId']}` of {sec['job']}.")
            lines += ["", "| artifact | version |", "| --- | --- |"]
            lines += [f"| `{o['nodeId']}` | {_short(o['version'])} |" for o in sec["outputs"]]
            lines.append("")
            if sec["config"]:
                lines += ["Configuration:", "", "```json", json.dumps(sec["config"], indent=2, sort_keys=True), "```"]
            else:
                lines.append("No configuration facet was recorded.")
            lines.append("")
    lines += ["## Evaluation", ""]
    if not report["evaluation"]:
        lines += ["No evaluation run found upstream.", ""]
    for ev in report["evaluation"]:
        outputs = ", ".join(f"`{o['nodeId']}`" for o in ev["outputs"]) or "—"
        lines.append(f"- {ev['job']} run `{ev['runId']}` → {outputs}")
        if ev["results"]:
            for name, res in ev["results"].items():
                lines.append(f"  - {name}: `{json.dumps(res, sort_keys=True)}`")
        else:
            lines.append("  - no result facet recorded (see the report artifact)")
    lines += ["", "## Artifacts", "", "| artifact | version (sha256) | produced by | run |", "| --- | --- | --- | --- |"]
    for a in report["artifacts"]:
        lines.append(f"| `{a['name']}` | {_md(a['version'])} | {_md(a['producedBy'])} | `{a['runId'][:8]}` |")
    lines += ["", "## Warnings", ""]
    lines += [f"- {w}" for w in report["warnings"]] or ["- none"]
    return "\n".join(lines) + "\n"
