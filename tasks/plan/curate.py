"""Paper estimate of a curation run (`crucible plan --curate SIZE`): core-hours per stage from the
per-core rates the benchmarks measured, then nodes, wall clock, storage and cost.

Every rate and keep fraction is read at run time from benchmarks/results/*.json (so a rerun benchmark
updates the plan) and reported with its file and key; the stages no other benchmark covers (line
dedup, exact-dedup keys, quality scoring, tokenization) are measured by benchmarks/stage_rates.py. A
figure no benchmark measures (line dedup's and tokenization's keep fraction, assumed 1) is flagged
`measured: false`. Conventions:

* core = one CPU as the OS counts it (the benchmarks' "per core"); per-core rates are assumed to scale
  linearly over cores and nodes (no scheduling, network or object-store overhead).
* documents flow through the stages in order; each stage's keep fraction shrinks the next one's input.
* storage: every stage's output shards are kept under run_root (intermediate), counted as raw text bytes
  (Parquet compression not subtracted, so an upper bound); the output is the curated text plus uint16
  token ids (vocab <= 65,536).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from tasks.config import CuratePlanConfig, IngestConfig, MinHashConfig
from tasks.core.constants import REPO_ROOT
from tasks.plan.planner import PlanError, _positive

INPUT_FORMATS = ("warc.gz", "wet", "text")
TOKEN_ID_BYTES = 2  # uint16 token ids (tasks/tokens/binfile.py) for a vocabulary up to 65,536
_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "pb": 1e15,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50}


def parse_size(text: str) -> float:
    """Bytes in '10TB', '500 GB', '1.5TiB' or '123456' (SI units are powers of 1000, *iB of 1024)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?(?:e[+-]?\d+)?)\s*([kmgtp]i?b|b)?\s*", str(text), re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise PlanError(f"curate size must be a positive size like 10TB, 500GB, 1.5TiB or a byte count, "
                        f"got {text!r}")
    return float(m.group(1)) * _UNITS[(m.group(2) or "").lower()]


@dataclass
class Figure:
    """One number taken from a benchmark result (or a stand-in), with where it came from."""
    value: float
    file: str
    key: str
    measured: bool = True
    note: str = ""

    def source(self) -> str:
        return f"{self.file} {self.key}" + ("" if self.measured else " (NOT MEASURED: stand-in)")


class Results:
    """The benchmark results in one directory, read lazily; keys are '/'-separated paths into the JSON
    ('runs/-1/docs' is the last run's docs)."""

    def __init__(self, rates_dir: str | Path):
        self.dir = Path(rates_dir)
        self._files: dict[str, dict] = {}

    def get(self, file: str, key: str) -> float:
        if file not in self._files:
            path = self.dir / file
            if not path.is_file():
                raise PlanError(f"rate file {path} is missing: run benchmarks/{path.stem}.py to measure it "
                                "(or point --rates-dir at a results directory that has it)")
            self._files[file] = json.loads(path.read_text())
        node = self._files[file]
        for part in key.split("/"):
            try:
                node = node[int(part)] if isinstance(node, list) else node[part]
            except (KeyError, IndexError, ValueError, TypeError):
                raise PlanError(f"{self.dir / file} has no {key!r} (failed at {part!r}): "
                                "rerun its benchmark or fix the file") from None
        if isinstance(node, bool) or not isinstance(node, (int, float)) or node < 0:
            raise PlanError(f"{self.dir / file} {key!r} is not a non-negative number: {node!r}")
        return float(node)

    def figure(self, file: str, key: str) -> Figure:
        return Figure(self.get(file, key), file, key)

    def ratio(self, file: str, num: str, *dens: str, note: str = "") -> Figure:
        """num / (den1 x den2 ...) from one file."""
        den = math.prod(self.get(file, d) for d in dens)
        if den <= 0:
            raise PlanError(f"{self.dir / file}: {' x '.join(dens)} is zero")
        return Figure(self.get(file, num) / den, file, f"{num} / {' x '.join(dens)}", note=note)


def _harmonic(parts: list[Figure], note: str) -> Figure:
    """Rate of running the parts one after another on the same item: 1 / sum(1 / rate)."""
    return Figure(1 / sum(1 / p.value for p in parts), " + ".join(p.file for p in parts),
                  " then ".join(p.key for p in parts), note=note)


def stage_figures(res: Results, extractor: str, verify: bool) -> list[dict]:
    """Per stage: name, unit of its items, per-core rate and keep fraction, each a Figure."""
    ext = f"comparison/speed/{extractor}"
    filters = res.ratio("filters_vs_datatrove.json", "documents", "crucible_with_langid/cpu_s",
                        note="filter chain with language id: documents per CPU-second of the process and its workers")
    stage = "stage_rates.json"
    keep_all = Figure(1.0, "-", "-", measured=False, note="not measured: assumed to drop no documents")
    mode = "verified" if verify else "unverified"
    return [
        {"stage": "extract", "unit": "pages",
         "rate": Figure(res.get("extraction.json", f"{ext}/pages_per_s_per_core"), "extraction.json",
                        f"{ext}/pages_per_s_per_core", note=f"{extractor} (ingest.extractor)"),
         "keep": res.ratio("extraction.json", f"{ext}/docs", f"{ext}/pages")},
        {"stage": "langid + filters", "unit": "docs", "rate": filters,
         "keep": res.ratio("filters_vs_datatrove.json", "crucible_kept", "documents")},
        {"stage": "line dedup", "unit": "docs",
         "rate": Figure(res.get(stage, "line_dedup/stage/docs_per_s_cpu"), stage, "line_dedup/stage/docs_per_s_cpu",
                        note="in-process line counting, then LineDedupFilter (its spaCy word count of shortened "
                             "documents, shared with the Gopher filter, counted here too: an upper bound)"),
         "keep": keep_all},
        {"stage": "exact/MinHash dedup", "unit": "docs",
         "rate": _harmonic([res.figure(stage, "exact_key/docs_per_s_cpu"),
                            res.figure("minhash.json", "signature/fast/docs_per_s_cpu"),
                            res.ratio("curate_scale.json", "runs/-1/docs", "runs/-1/timings/dedup_s", "cpus")],
                           note="exact-dedup keys, then MinHash signatures, then the curate stage's URL / exact / "
                                "MinHash dedup steps on Ray at the largest measured size (wall seconds x CPUs)"),
         "keep": Figure(1 - res.get("dedup_quality.json", f"real/{mode}/dropped") / res.get("dedup_quality.json", "real/docs"),
                        "dedup_quality.json", f"1 - real/{mode}/dropped / real/docs")},
        {"stage": "quality scoring", "unit": "docs",
         "rate": Figure(res.get(stage, "quality/score/docs_per_s_cpu"), stage, "quality/score/docs_per_s_cpu",
                        note="fastText classifier + KenLM perplexity per document, then the keep decision "
                             "(configs/tiny.yaml's models; training not counted)"),
         "keep": res.ratio("ablation.json", "arms/curated/quality_docs_out", "arms/curated/curate_docs_out")},
        {"stage": "tokenization", "unit": "docs",
         "rate": Figure(res.get(stage, "tokenization/encode/docs_per_s_cpu"), stage,
                        "tokenization/encode/docs_per_s_cpu",
                        note="byte-level BPE encoding and packing into uint16 shards (tokenizer training not counted)"),
         "keep": keep_all},
    ]


def _cluster(core_hours: float, cfg: CuratePlanConfig, nodes: int | None) -> dict:
    cores = cfg.cores_per_node
    if nodes is None:
        nodes = max(1, math.ceil(core_hours / (cores * cfg.target_hours)))
    hours = core_hours / (nodes * cores)
    return {"nodes": nodes, "cores_per_node": cores, "hours": hours, "node_hours": nodes * hours,
            "node_price_per_hour": cfg.node_price_per_hour, "compute_cost_usd": nodes * hours * cfg.node_price_per_hour}


def _storage(size: float, stages: list[dict], text_per_doc: Figure, bytes_per_token: Figure,
             price: float) -> dict:
    text_stages = [s for s in stages if s["stage"] not in ("quality scoring", "tokenization")]
    intermediate = sum(s["items_out"] for s in text_stages) * text_per_doc.value
    curated_docs = next(s["items_out"] for s in stages if s["stage"] == "quality scoring")
    curated_text = curated_docs * text_per_doc.value
    tokens = curated_text / bytes_per_token.value
    output = curated_text + tokens * TOKEN_ID_BYTES
    total = size + intermediate + output
    return {"input_bytes": size, "intermediate_bytes": intermediate, "curated_text_bytes": curated_text,
            "tokens": tokens, "output_bytes": output, "total_bytes": total,
            "price_per_gb_month": price, "cost_usd_per_month": total / 1e9 * price,
            "text_bytes_per_doc": asdict(text_per_doc), "bytes_per_token": asdict(bytes_per_token)}


def make_curate_plan(size: str | float, input_format: str = "warc.gz", nodes: int | None = None,
                     cfg: CuratePlanConfig | None = None, rates_dir: str | Path | None = None) -> dict:
    """Price curating `size` bytes (a number or '10TB') of `input_format`; see the module docstring.
    `nodes` None picks the fewest nodes finishing within cfg.target_hours. Raises PlanError."""
    cfg = cfg or CuratePlanConfig()
    size_bytes = parse_size(size) if isinstance(size, str) else float(size)
    _positive("size", size_bytes)
    _positive("nodes", nodes, integer=True)
    if input_format not in INPUT_FORMATS:
        raise PlanError(f"unknown input format {input_format!r}; known: {', '.join(INPUT_FORMATS)}")
    res = Results(Path(rates_dir or cfg.rates_dir) if Path(rates_dir or cfg.rates_dir).is_absolute()
                  else REPO_ROOT / (rates_dir or cfg.rates_dir))
    extractor = IngestConfig.model_fields["extractor"].default
    stages = stage_figures(res, extractor, MinHashConfig.model_fields["verify"].default)
    if input_format != "warc.gz":  # already text: no HTML extraction
        stages = stages[1:]
    per_page = res.figure("page_sizes.json", f"formats/{input_format}/bytes_per_page")
    items = size_bytes / per_page.value
    for s in stages:
        s["items_in"] = items
        s["core_hours"] = items / s["rate"].value / 3600
        items = s["items_out"] = items * s["keep"].value
    core_hours = sum(s["core_hours"] for s in stages)
    cluster = _cluster(core_hours, cfg, nodes)
    storage = _storage(size_bytes, stages, res.figure("page_sizes.json", "formats/text/bytes_per_page"),
                       res.ratio("ablation.json", "arms/curated/bytes", "arms/curated/train_tokens_available",
                                 note="the demo's tokenizer (4,096-token vocabulary)"),
                       cfg.storage_price_per_gb_month)
    return {
        "size_bytes": size_bytes, "input_format": input_format, "bytes_per_page": asdict(per_page),
        "pages": size_bytes / per_page.value,
        "rates_dir": str(res.dir.relative_to(REPO_ROOT) if res.dir.is_relative_to(REPO_ROOT) else res.dir),
        "stages": [{**s, "rate": asdict(s["rate"]), "keep": asdict(s["keep"])} for s in stages],
        "core_hours": core_hours, **cluster, "storage": storage,
        "total_cost_usd": cluster["compute_cost_usd"] + storage["cost_usd_per_month"],
        "not_measured": sorted({s["stage"] for s in stages if not s["rate"].measured}),
        "assumptions": [
            "core = one CPU as the OS counts it (a vCPU on a cloud node); per-core rates scale linearly",
            f"nodes: {'given' if nodes else f'the fewest finishing within {cfg.target_hours:g} h'}; compute "
            f"cost = nodes x hours x ${cfg.node_price_per_hour:g}/node-hour (plan.curate.node_price_per_hour)",
            f"storage for one month at ${cfg.storage_price_per_gb_month:g}/GB-month; intermediate = every text "
            "stage's output as raw text (upper bound), output = curated text + uint16 token ids",
            "the rates were measured on a shared 2-core machine on small corpora (docs crawl, CC samples); "
            "keep fractions of a real crawl differ (e.g. language id drops most non-English pages)",
        ],
    }
