"""Does curation help the model? Run the curation ablation on a config (default configs/tiny.yaml) and
write the figures to benchmarks/results/ablation.json.

    .venv/bin/python benchmarks/ablation.py [--config configs/tiny.yaml] [--set k=v ...]
    .venv/bin/python benchmarks/ablation.py --from runs/<run>/ablate/ablation.json   # a finished run

Arms: (a) extracted text after language ID only, (b) the fully curated corpus (filters, dedup,
decontamination, PII, model-based quality). Same model, same token budget, one tokenizer trained on
(b); both scored on WikiText-2 validation. Target (issue 4): (b) ≥ 5 % lower held-out loss than (a).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from _common import write_result  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(REPO / "configs" / "tiny.yaml"))
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--from", dest="from_json", help="report an existing ablation.json instead of running")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "ablation.json"))
    args = ap.parse_args()
    result = json.loads(Path(args.from_json).read_text()) if args.from_json else run(args.config, args.overrides)
    out = summarise(args, result)
    print_summary(out)
    write_result(args.out, out)
    return 0


def run(config: str, overrides: list[str]) -> dict:
    """The ablation on `config`, in a fresh temporary work directory (kept for ablation_bound.py)."""
    from tasks.ablate import run_ablation
    from infra.settings import load_config

    work = Path(tempfile.mkdtemp(prefix="crucible-ablation-"))
    cfg = load_config(config, [f"run_root={work / 'runs'}", *overrides])
    return run_ablation(cfg, work / "ablate", f"sqlite:///{work / 'mlflow.db'}")


def summarise(args: argparse.Namespace, result: dict) -> dict:
    """The figures of an ablation.json worth keeping in benchmarks/results/."""
    return {
        "benchmark": "ablation",
        "config": args.config,
        "overrides": args.overrides,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "heldout_loss": result["heldout_loss"],
        "relative_improvement": result["relative_improvement"],
        "target_improvement": result["target_improvement"],
        "meets_target": result["meets_target"],
        "token_budget": result["token_budget"],
        "tokenizer": {"trained_on": result["tokenizer"]["trained_on"], "vocab_size": result["tokenizer"]["vocab_size"]},
        "eval": {k: result["eval"][k] for k in ("tokens", "sha256", "detokenize")} | {
            "file": Path(result["eval"]["path"]).name},
        "arms": {arm: {"docs": a["corpus"]["docs"], "bytes": a["corpus"]["bytes"],
                       "train_tokens_available": a["train_tokens_available"], "tokens_trained": a["tokens_trained"],
                       "epochs": a["epochs"], "final_train_loss": a["final_train_loss"],
                       "heldout_loss": a["heldout_loss"], "heldout_perplexity": a["heldout_perplexity"],
                       "curate_docs_in": a["curate"]["docs_in"], "curate_docs_out": a["curate"]["docs_out"],
                       "quality_docs_out": a["quality"]["docs_out"],
                       "by_source": a["corpus"].get("by_source", {})} for arm, a in result["arms"].items()},
        "seconds": result.get("seconds"),
    }


def print_summary(out: dict) -> None:
    print(f"{'arm':<14}{'docs':>7}{'train tokens':>14}{'epochs':>8}{'held-out loss':>15}")
    for arm, a in out["arms"].items():
        print(f"{arm:<14}{a['docs']:>7}{a['train_tokens_available']:>14,}{a['epochs']:>8.2f}{a['heldout_loss']:>15.4f}")
    print(f"relative improvement of curated over langid-only: {100 * out['relative_improvement']:.2f} % "
          f"(target ≥ {100 * out['target_improvement']:.0f} %: {'met' if out['meets_target'] else 'MISSED'})")


if __name__ == "__main__":
    sys.exit(main())
