"""The curated output is the one the driver-side dedup gave before curation moved to file-passing
stages (issue 26): on the real sample of `configs/tiny.yaml`'s sources (ingested by the real
ingest stage) and on test_curate's sample with the Ray clustering, verification and the quality
survivor, the curated ids, dropped.jsonl and the drop counts equal those captured from the old
code (tests/data/curate_golden.json, written by `python tests/test_curate_golden.py` at commit
0893e0b, before the change)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))  # test_curate's sample when run as a script
GOLDEN = HERE / "data" / "curate_golden.json"


def _outcome(summary: dict) -> dict:
    from tasks.core.documents import iter_docs

    return {"ids": [d["id"] for d in iter_docs(summary["shards"])],
            "shard_rows": [sum(1 for _ in iter_docs([p])) for p in summary["shards"]],
            "dropped_file": Path(summary["dropped_file"]).read_text().splitlines(),
            "dropped": summary["dropped"],
            "dedup": {k: summary["dedup"][k] for k in ("by_source", "cluster_sizes", "examples", "duplicates")}}


def golden_runs(root: Path) -> dict:
    """Each run's curated outcome: "tiny" (configs/tiny.yaml's sources through ingest + curate,
    its curate defaults), "sample-ray" (test_curate's sample in 4 input shards; MinHash on Ray in
    3 partitions with text verification and the quality survivor on `language_score`)."""
    from test_curate import web_sample_docs  # test_curate's sample (skips cleanly without data)

    from tasks.config import RayConfig, load_config
    from tasks.core.documents import write_docs
    from tasks.curate import run_curate
    from tasks.ingest.run import run_ingest

    out = {}
    cfg = load_config(HERE.parent / "configs" / "tiny.yaml")
    cfg = cfg.model_copy(update={"ray": RayConfig(num_cpus=2)})
    ing = run_ingest(cfg, root / "tiny-ingest")
    out["tiny"] = _outcome(run_curate(cfg, [Path(p) for p in ing["shards"]], root / "tiny-curate"))

    docs = web_sample_docs()
    shards = write_docs(docs, root / "sample-in", shard_docs=190)
    mh = {"clustering": "ray", "ray_min_docs": 1, "partitions": 3, "verify": True, "verify_threshold": 0.8,
          "survivor": "quality", "quality_field": "language_score"}
    c = cfg.curate.model_dump()
    c["shard_docs"] = 150
    c["dedup"]["minhash"].update(mh)
    scfg = cfg.model_validate({**cfg.model_dump(), "curate": c})
    out["sample-ray"] = _outcome(run_curate(scfg, shards, root / "sample-out"))
    return out


def test_curated_output_equals_the_driver_side_dedup(ray_session, tmp_path):
    if not GOLDEN.is_file():
        pytest.fail(f"{GOLDEN} missing")
    want = json.loads(GOLDEN.read_text())
    got = json.loads(json.dumps(golden_runs(tmp_path)))
    for name in want:
        assert got[name]["dropped"] == want[name]["dropped"], name
        assert got[name]["ids"] == want[name]["ids"], name
        assert got[name]["dropped_file"] == want[name]["dropped_file"], name
        assert got[name] == want[name], name
    assert sum(want["tiny"]["dropped"].get(k, 0) for k in ("url_dedup", "exact_dedup", "minhash_dedup")) > 0


if __name__ == "__main__":
    import tempfile

    import ray

    from tasks.config import RayConfig
    from tasks.core.ray_utils import init_ray

    init_ray(RayConfig(num_cpus=2))
    with tempfile.TemporaryDirectory() as d:
        res = golden_runs(Path(d))
    ray.shutdown()
    GOLDEN.write_text(json.dumps(res, indent=0, sort_keys=True) + "\n")
    print({k: (len(v["ids"]), v["dropped"]) for k, v in res.items()})
