"""Crucible's OpenLineage facets and the dataset/job facets built from real artifacts.

Custom facets carry the `crucible_` prefix; each has a JSON schema in docs/lineage-facets/ that its
`_schemaURL` names (documented in docs/lineage-facets.md), so tasks/lineage/validate.py checks them
like the standard ones. Standard facets used on datasets: `version` (sha256 of the content),
`schema` (Parquet columns), `dataQualityMetrics` (rows, bytes, files), `documentation`,
`ownership`; on inputs/outputs: `dataQualityMetrics` / `outputStatistics`; on jobs:
`jobType`, `sourceCodeLocation`, `documentation`, `ownership`.
"""
from __future__ import annotations

import subprocess
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable

import attr
from openlineage.client.facet_v2 import (
    DatasetFacet,
    RunFacet,
    data_quality_metrics_dataset,
    documentation_dataset,
    documentation_job,
    ownership_dataset,
    ownership_job,
    schema_dataset,
    source_code_location_job,
)

from tasks.core.constants import REPO_ROOT

FACET_SCHEMA_DIR = REPO_ROOT / "docs" / "lineage-facets"
# Where docs/lineage-facets/*.json are published; the validator maps this prefix to FACET_SCHEMA_DIR.
CUSTOM_FACET_SCHEMA_BASE = "https://raw.githubusercontent.com/crucible-ml/crucible/main/docs/lineage-facets/"


def custom_schema_url(facet_class: str) -> str:
    return f"{CUSTOM_FACET_SCHEMA_BASE}{facet_class}.json#/$defs/{facet_class}"


class CustomSchema:
    """Mixin of Crucible's facets: `_schemaURL` is the schema named after the class in docs/lineage-facets/."""

    __slots__ = ()

    @classmethod
    def _get_schema(cls) -> str:
        return custom_schema_url(cls.__name__)


# ------------------------------------------------------------------------------- custom facets


@attr.define
class CrucibleSourceDatasetFacet(CustomSchema, DatasetFacet):
    """Licence and provenance. On a raw file: its entry in the config's source registry. On anything
    derived from raw files (`derived: true`): the union of the raw sources it came from, so a
    curated shard, the tokenizer, a checkpoint or a model version lists every licence upstream."""

    source: str  # registry name; derived: the names joined by ", "
    licence: str  # derived: the distinct licences joined by " | "
    provenance: str
    derived: bool = False
    licences: list[str] = attr.field(factory=list)  # distinct licences, sorted
    sources: list[dict] = attr.field(factory=list)  # derived: [{source, licence, provenance}], by name
    # "evaluation": benchmark data a job scores with (not training data); its licence is recorded on
    # the file but not propagated to what the job writes, and it is not a source of the model
    use: str | None = None

    @classmethod
    def raw(cls, name: str, licence: str, provenance: str) -> "CrucibleSourceDatasetFacet":
        return cls(source=name, licence=licence, provenance=provenance, derived=False, licences=[licence])

    @classmethod
    def evaluation(cls, name: str, licence: str, provenance: str) -> "CrucibleSourceDatasetFacet":
        return cls(source=name, licence=licence, provenance=provenance, derived=False, licences=[licence],
                   use="evaluation")

    @classmethod
    def union(cls, entries: Iterable[dict]) -> "CrucibleSourceDatasetFacet | None":
        """The derived facet over raw source entries {source, licence, provenance} (None if none)."""
        by_name: dict[str, dict] = {}
        for e in entries:
            by_name.setdefault(e["source"], {"source": e["source"], "licence": e["licence"],
                                             "provenance": e["provenance"]})
        if not by_name:
            return None
        sources = [by_name[k] for k in sorted(by_name)]
        licences = sorted({s["licence"] for s in sources})
        names = ", ".join(s["source"] for s in sources)
        return cls(source=names, licence=" | ".join(licences), derived=True, licences=licences, sources=sources,
                   provenance=f"derived from the raw sources {names} (see `sources`)")


def source_entries(facet: Any) -> list[dict]:
    """Raw source entries of a crucible_source facet (object or dict; raw or derived)."""
    if facet is None:
        return []
    d = facet if isinstance(facet, dict) else attr.asdict(facet)
    if d.get("use") == "evaluation":  # benchmark data: licence recorded, never propagated
        return []
    if d.get("derived"):
        return [s for s in d.get("sources") or [] if isinstance(s, dict) and "source" in s]
    if "source" in d and "licence" in d:
        return [{"source": d["source"], "licence": d["licence"], "provenance": d.get("provenance", "")}]
    return []


@attr.define
class CrucibleTokenMixDatasetFacet(CustomSchema, DatasetFacet):
    """A continued-pretraining cycle's training mix: its new and replayed tokens, overall and per
    data source (source -> {new_tokens, replay_tokens, tokens, share})."""

    replay_fraction: float
    replay_share: float
    new_tokens: int
    replay_tokens: int
    by_source: dict = attr.field(factory=dict)


@attr.define
class CrucibleMixtureDatasetFacet(CustomSchema, DatasetFacet):
    """The sources' mixture weights applied to a token index's train split (tasks/tokens/mixture.py):
    per source its weight, natural and written documents and tokens, target and effective token
    share, documents dropped and repeated; `dropped` counts documents included zero times."""

    split: str
    seed: int
    applied: bool
    by_source: dict = attr.field(factory=dict)
    dropped: dict = attr.field(factory=dict)


@attr.define
class CrucibleServingDatasetFacet(CustomSchema, DatasetFacet):
    """A model deployment: the OpenAI-compatible endpoint and the registered model version it serves."""

    endpoint: str
    model_name: str
    model_version: int
    model_uri: str  # models:/<name>/<version> in the MLflow registry


@attr.define
class CrucibleStatsRunFacet(CustomSchema, RunFacet):
    """Documents in/out of a stage and the documents each filter dropped."""

    stage: str
    docs_in: int
    docs_out: int
    dropped: dict = attr.field(factory=dict)


@attr.define
class CrucibleConfigRunFacet(CustomSchema, RunFacet):
    """The config section a stage ran with."""

    config: dict


@attr.define
class CrucibleEvalRunFacet(CustomSchema, RunFacet):
    """Evaluation results of one checkpoint."""

    val_loss: float
    perplexity: float
    step: int


@attr.define
class CrucibleSignatureRunFacet(CustomSchema, RunFacet):
    """The stack's HMAC of the event without this facet (tasks/lineage/signed.py): a line of a run's
    lineage log that does not carry a valid one is refused by every reader and never replayed."""

    signature: str


@attr.define
class CrucibleEnergyRunFacet(CustomSchema, RunFacet):
    """Energy, CO2e and cost of the stage run, measured by tasks/core/energy.py (`method` says how)."""

    energy_kwh: float
    cpu_kwh: float
    gpu_kwh: float
    co2e_kg: float
    cost_usd: float
    cpu_core_seconds: float
    gpu_hours: float
    grid_gco2e_per_kwh: float
    method: str

    @classmethod
    def of(cls, record: dict) -> "CrucibleEnergyRunFacet":
        return cls(energy_kwh=record["kwh"], **{k: record[k] for k in (
            "cpu_kwh", "gpu_kwh", "co2e_kg", "cost_usd", "cpu_core_seconds", "gpu_hours", "grid_gco2e_per_kwh",
            "method")})


# An id, name or URL of the run in another tool; None where that tool had no part in it.
Link = str | None


@attr.define
class CrucibleLinksRunFacet(CustomSchema, RunFacet):
    """Where the same run shows up in the other tools: MLflow run and Prefect flow/task run."""

    mlflow_run_id: Link = None
    mlflow_run_url: Link = None
    mlflow_experiment: Link = None
    prefect_flow_run_id: Link = None
    prefect_flow_run_url: Link = None
    prefect_task_run_id: Link = None
    prefect_task_run_url: Link = None


# --------------------------------------------------------------------------- standard facets


@attr.define
class DataQualityMetricsDatasetFacet(data_quality_metrics_dataset.DataQualityMetricsDatasetFacet):
    """The dataset-level `dataQualityMetrics` facet, pinned to spec version 1-0-0: the client's
    default (1-0-1) is not in the spec copy events are validated against; the fields used here
    (rowCount, bytes, fileCount, columnMetrics) are the same in both."""

    @staticmethod
    def _get_schema() -> str:
        return ("https://openlineage.io/spec/facets/1-0-0/DataQualityMetricsDatasetFacet.json"
                "#/$defs/DataQualityMetricsDatasetFacet")


def documentation(description: str) -> documentation_dataset.DocumentationDatasetFacet:
    return documentation_dataset.DocumentationDatasetFacet(description=description)


def job_documentation(description: str) -> documentation_job.DocumentationJobFacet:
    return documentation_job.DocumentationJobFacet(description=description)


def dataset_ownership(owner: str) -> ownership_dataset.OwnershipDatasetFacet:
    return ownership_dataset.OwnershipDatasetFacet(owners=[ownership_dataset.Owner(name=owner, type="MAINTAINER")])


def job_ownership(owner: str) -> ownership_job.OwnershipJobFacet:
    return ownership_job.OwnershipJobFacet(owners=[ownership_job.Owner(name=owner, type="MAINTAINER")])


def parquet_info(path: str | Path) -> tuple[list[tuple[str, str]], int] | None:
    """([(column, arrow type)], rows) from a Parquet file's footer (no data is read); None if the
    file is not Parquet."""
    st = Path(path).stat()
    return _parquet_info(str(path), st.st_mtime_ns, st.st_size)


@lru_cache(maxsize=256)
def _parquet_info(path: str, mtime_ns: int, size: int) -> tuple[list[tuple[str, str]], int] | None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path).metadata
    except (pa.ArrowException, OSError):
        return None
    schema = meta.schema.to_arrow_schema()
    return [(f.name, str(f.type)) for f in schema], meta.num_rows


def schema_facet(columns: list[tuple[str, str]]) -> schema_dataset.SchemaDatasetFacet:
    return schema_dataset.SchemaDatasetFacet(fields=[
        schema_dataset.SchemaDatasetFacetFields(name=name, type=type_, ordinal_position=i + 1)
        for i, (name, type_) in enumerate(columns)])


def parquet_values(path: str | Path, column: str) -> list[str]:
    """Distinct non-null values of one column of a Parquet file (read column by column, row group
    by row group), e.g. the sources a shard's documents came from; [] if there is no such column."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    import pyarrow as pa

    try:
        f = pq.ParquetFile(str(path))
    except (pa.ArrowException, OSError):
        return []
    if column not in f.schema_arrow.names:
        return []
    seen: set[str] = set()
    for i in range(f.num_row_groups):
        col = f.read_row_group(i, columns=[column]).column(0)
        seen.update(v for v in pc.unique(col).to_pylist() if v is not None)
    return sorted(seen)


def data_readme_entry(path: str | Path, data_root: str | Path) -> dict | None:
    """{"file", "origin", "licence", "how_made", "sha256"} of a file of the shared data folder, from
    the file table of its README.md (`| file | origin | license | how made | ... | sha256 |`, paths
    relative to data_root); None when the file is outside data_root or not listed."""
    path, root = Path(path).resolve(), Path(data_root).resolve()
    try:
        rel = path.relative_to(root).as_posix()
    except ValueError:
        return None
    readme = root / "README.md"
    try:
        st = readme.stat()
    except OSError:
        return None
    return _readme_table(str(readme), st.st_mtime_ns, st.st_size).get(rel)


@lru_cache(maxsize=4)
def _readme_table(readme: str, mtime_ns: int, size: int) -> dict[str, dict]:
    rows: dict[str, dict] = {}
    header: list[str] | None = None
    for line in Path(readme).read_text(encoding="utf-8").splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = [c.lower() for c in cells]
            continue
        if not {"file", "license"} <= set(header) or len(cells) != len(header) or set(cells[0]) <= {"-", " "}:
            continue
        row = dict(zip(header, cells))
        name = row["file"].strip("`")
        rows[name] = {"file": name, "origin": row.get("origin", ""), "licence": row["license"],
                      "how_made": row.get("how made", ""), "sha256": row.get("sha256", "").strip("`")}
    return rows


def count_lines(path: Path) -> int:
    n = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            n += chunk.count(b"\n")
    return n


def file_stats(path: Path) -> dict[str, Any]:
    """What can be known cheaply about a local artifact: bytes, files, and for Parquet and JSONL
    files the row count (Parquet also its columns)."""
    if path.is_dir():
        files = [p for p in path.rglob("*") if p.is_file()]
        return {"bytes": sum(p.stat().st_size for p in files), "files": len(files)}
    out: dict[str, Any] = {"bytes": path.stat().st_size, "files": 1}
    if path.suffix == ".parquet":
        info = parquet_info(path)
        if info is not None:
            out["columns"], out["rows"] = info
    elif path.suffix == ".jsonl":
        out["rows"] = count_lines(path)
    return out


# ------------------------------------------------------------------------------ source code


def _git(*args: str) -> str | None:
    try:
        r = subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() or None if r.returncode == 0 else None


def _uri(remote: str) -> str:
    """A git remote as a URI: `git@host:org/repo.git` (scp-like) becomes `ssh://git@host/org/repo.git`."""
    if "://" in remote:
        return remote
    if ":" in remote and not remote.startswith("/"):
        host, path = remote.split(":", 1)
        return f"ssh://{host}/{path.lstrip('/')}"
    return Path(remote).resolve().as_uri()


@lru_cache(maxsize=1)
def git_info() -> dict[str, str | None]:
    """{commit, branch, url} of the repository this code runs from (url: `origin`, else the path)."""
    remote = _git("remote", "get-url", "origin")
    branch = _git("rev-parse", "--abbrev-ref", "HEAD")
    return {"commit": _git("rev-parse", "HEAD"), "branch": None if branch == "HEAD" else branch,
            "url": _uri(remote) if remote else REPO_ROOT.as_uri()}


def source_code_location(path: str | None) -> source_code_location_job.SourceCodeLocationJobFacet | None:
    """`sourceCodeLocation` for a job defined in `path` (relative to the repository)."""
    info = git_info()
    if not info["commit"]:
        return None
    return source_code_location_job.SourceCodeLocationJobFacet(
        type="git", url=info["url"], repoUrl=info["url"], path=path, version=info["commit"], branch=info["branch"])
