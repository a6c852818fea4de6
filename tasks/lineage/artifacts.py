"""Lineage datasets of artifacts that several jobs read: token shards and evaluation data."""
from __future__ import annotations

import json
from pathlib import Path

from tasks.core.fs import PathEscape, is_file, is_remote, listed_beside, read_text
from tasks.core.storage import stored
from tasks.lineage.emitter import dataset_for_path
from tasks.lineage.facets import CrucibleSourceDatasetFacet, data_readme_entry

EVAL_DATA_DOC = ("Evaluation data of the {task} task of the suite (tasks/evaluate/suite.py), read unchanged "
                 "from the shared data folder; scored, never trained on.")


def token_split_paths(tokens_index: str | Path, splits: tuple[str, ...] | None = None) -> list[Path | str]:
    """The token shards an index.json lists (files beside it, or absolute), all or only `splits`;
    [] when the index cannot be read. An index on a store (its URI) lists its objects' URIs."""
    if is_remote(tokens_index):
        return _stored_split_uris(str(tokens_index), splits)
    index = Path(tokens_index)
    try:
        listed = json.loads(index.read_text()).get("splits", {})
    except (OSError, ValueError, AttributeError):
        return []
    paths = []
    for name, info in listed.items() if isinstance(listed, dict) else []:
        if splits is not None and name not in splits:
            continue
        path = info.get("path") or info.get("file") if isinstance(info, dict) else None
        if path and (p := listed_beside(index, path)).is_file():
            paths.append(p)
    return paths


def _stored_split_uris(index: str, splits: tuple[str, ...] | None) -> list[str]:
    at, options = stored(index)
    try:
        listed = json.loads(read_text(at, options)).get("splits", {})
    except (OSError, ValueError, AttributeError):
        return []
    found = [info.get("path") for name, info in listed.items() if isinstance(info, dict)
             and (splits is None or name in splits)]
    uris = []
    for p in found:
        try:
            uris += [listed_beside(at, p)] if p else []
        except PathEscape:  # a name that would be another object: not the split
            continue
    return [u for u in uris if is_file(u, options)]


def eval_data_facet(task: str, path: str | Path, data_root: str | Path) -> CrucibleSourceDatasetFacet:
    """The crucible_source facet (use: evaluation) of an evaluation data file: licence and origin from
    the data README's file table, or a licence that says none is recorded."""
    entry = data_readme_entry(path, data_root)
    readme = Path(data_root) / "README.md"
    if entry is None:
        return CrucibleSourceDatasetFacet.evaluation(
            task, "unknown (not listed in the data README)", f"{Path(path).resolve()}; not listed in {readme}")
    origin = entry["origin"].replace("`", "")
    provenance = f"{origin} ({entry['how_made']}); listed in {readme}"
    if entry["sha256"]:
        provenance += f" with sha256 {entry['sha256']}"
    return CrucibleSourceDatasetFacet.evaluation(task, entry["licence"], provenance)


def eval_data_inputs(report: dict, data_root: str | Path) -> list:
    """Input datasets for the evaluation data an evaluation report's task suite read
    (report["tasks"][task]["data"]), versioned by content hash, with their licence facet."""
    inputs, seen = [], set()
    for task, info in (report.get("tasks") or {}).items():
        path = info.get("data") if isinstance(info, dict) else None
        if not path or not Path(path).is_file() or Path(path).resolve() in seen:
            continue
        seen.add(Path(path).resolve())
        inputs.append(dataset_for_path(path, source=eval_data_facet(task, path, data_root),
                                       doc=EVAL_DATA_DOC.format(task=task)))
    return inputs
