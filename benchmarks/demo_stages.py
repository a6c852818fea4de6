"""Time the demo (`configs/tiny.yaml`) per stage through the real local stack; print the figures and
write a JSON result to benchmarks/results/demo_stages.json.

    .venv/bin/python benchmarks/demo_stages.py [--config configs/tiny.yaml] [--set k=v ...]

Target (issue 2): the whole demo in ≤ 10 minutes on 2 cores after install.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TARGET_S = 600


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(REPO / "configs" / "tiny.yaml"))
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "demo_stages.json"))
    args = ap.parse_args()
    summary_path = Path(tempfile.mkdtemp()) / "summary.json"
    sets = [a for o in args.overrides for a in ("--set", o)]
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "infra.cli", "run", args.config, *sets, "--summary", str(summary_path)],
                          cwd=REPO, env=os.environ.copy())
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        print(f"demo failed (exit {proc.returncode})", file=sys.stderr)
        return proc.returncode
    summary = json.loads(summary_path.read_text())
    result = {
        "benchmark": "demo_stages",
        "config": args.config,
        "overrides": args.overrides,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "wall_s": round(wall, 1),
        "stages_s": summary["timings_s"],
        "target_s": TARGET_S,
        "within_target": wall <= TARGET_S,
        "counts": {
            "docs_raw": summary["stages"]["ingest"]["docs_in"],
            "docs_curated": summary["stages"]["curate"]["docs_out"],
            "train_steps": summary["stages"]["train"]["steps"],
            "first_loss": summary["stages"]["train"]["first_loss"],
            "final_loss": summary["stages"]["train"]["final_loss"],
        },
    }
    print(f"{'stage':<12}{'seconds':>10}")
    for k, v in summary["timings_s"].items():
        print(f"{k:<12}{v:>10.1f}")
    print(f"{'wall':<12}{wall:>10.1f}   (target ≤ {TARGET_S} s: {'met' if wall <= TARGET_S else 'MISSED'})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
