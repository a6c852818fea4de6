"""Ingest stage: raw WARC/WET/JSONL sources → normalised documents in sharded Parquet.

Public API: `run_ingest(cfg, out_dir) -> summary dict` (see `tasks.ingest.run`).
"""
from tasks.ingest.run import run_ingest

__all__ = ["run_ingest"]
