"""How much could selection from this data help? Oracle-guided subsets for the curation ablation.

    .venv/bin/python benchmarks/ablation_bound.py --work /tmp/crucible-ablation-XXXX/ablate \
        [--fractions 0.2 0.35 0.5] [--config configs/tiny.yaml]

`--work` is the work directory a finished `benchmarks/ablation.py` run leaves behind (its
ablation.json names the arms' shards and the shared tokenizer). From the langid-only pool this
script picks subsets with knowledge no real curation has: the target domain itself. Each document
is scored DSIR-style (Xie et al. 2023, importance weights over hashed token unigrams and bigrams)
by how much more likely it is under WikiText-2 *test* than under the pool, and the top fraction is
kept. The same model is trained on each subset with the same token budget and tokenizer as the two
ablation arms, and scored on the same held-out text (WikiText-2 *valid*; test and valid are
different articles). This is not a proof of a bound (DSIR top-k is one selection among many), but
a selection that knows the evaluation domain is what a real filter can at best approximate: if it
misses the target, the pool is the limit far more than the filters. Small subsets are repeated
over more epochs, as the curated arm is (the figures give the epochs). `--config`/`--set` must give
the ablation's own training config (checked: the same token budget). Prints the figures and
writes benchmarks/results/ablation_bound.json.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from _common import data_root, write_result  # noqa: E402

BUCKETS = 1 << 18


def hashed_counts(ids: np.ndarray) -> np.ndarray:
    """Counts of the token unigrams and (hashed) bigrams of one token sequence."""
    big = (ids[:-1].astype(np.uint64) * np.uint64(1_000_003) + ids[1:].astype(np.uint64)) % np.uint64(BUCKETS)
    feats = np.concatenate([ids.astype(np.uint64) % np.uint64(BUCKETS), big])
    return np.bincount(feats.astype(np.int64), minlength=BUCKETS)


def dsir_scores(docs: list[np.ndarray], target: np.ndarray) -> np.ndarray:
    """Per document: mean log importance weight log p_target(f) - log p_pool(f) over its features."""
    pool = np.zeros(BUCKETS)
    for d in docs:
        pool += hashed_counts(d)
    tgt = hashed_counts(target).astype(np.float64)
    log_w = np.log((tgt + 1) / (tgt.sum() + BUCKETS)) - np.log((pool + 1) / (pool.sum() + BUCKETS))
    return np.array([float(hashed_counts(d) @ log_w) / max(1, 2 * len(d) - 1) for d in docs])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True, help="an ablation work directory (has ablation.json)")
    ap.add_argument("--config", default=str(REPO / "configs" / "tiny.yaml"))
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.2, 0.35, 0.5])
    ap.add_argument("--target", default=str(data_root() / "eval" / "wikitext-2" / "test.txt"))
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "ablation_bound.json")
    args = ap.parse_args()

    import pyarrow as pa
    import pyarrow.parquet as pq

    from tasks.ablate.run import corpus_stats, eval_tokens, heldout_loss, langid_only
    from infra.settings import load_config
    from tasks.evaluate.suite import load_wikitext_pages, wikitext_detokenizer
    from tasks.tokenizer.bpe import load_tokenizer
    from tasks.tokens import prepare_tokens
    from tasks.tracking import Tracker
    from tasks.train import run_training

    t0 = time.perf_counter()
    work = args.work.resolve()
    ablation = json.loads((work / "ablation.json").read_text())
    cfg = load_config(args.config, [f"run_root={work / 'bound-runs'}", *args.overrides])
    acfg = langid_only(cfg)  # same training config as the arms; no stage below curates
    from tasks.plan import global_batch_tokens

    budget = acfg.train.max_steps * global_batch_tokens(acfg)
    if budget != ablation["token_budget"]["tokens"]:
        raise SystemExit(f"the config gives a budget of {budget:,} tokens, the ablation trained "
                         f"{ablation['token_budget']['tokens']:,}: pass the ablation's --config/--set")
    tokenizer_path = Path(ablation["tokenizer"]["path"])
    tok = load_tokenizer(tokenizer_path)
    eos = tok.token_to_id(cfg.tokenizer.eos_token)
    held = eval_tokens(cfg, tokenizer_path)

    pool = pa.concat_tables([pq.read_table(s) for s in ablation["arms"]["langid_only"]["shards"]])
    texts = pool.column("text").to_pylist()
    docs = [np.asarray(e.ids + [eos]) for e in tok.encode_batch(texts, add_special_tokens=False)]
    pages = [wikitext_detokenizer(p) for p in load_wikitext_pages(Path(args.target))]
    target = np.asarray([i for e in tok.encode_batch(pages, add_special_tokens=False) for i in e.ids + [eos]])
    order = np.argsort(-dsir_scores(docs, target), kind="stable")

    tracking_uri = f"sqlite:///{work / 'bound-mlflow.db'}"
    tracker = Tracker(tracking_uri, "ablation-bound")
    la, lb = ablation["heldout_loss"]["langid_only"], ablation["heldout_loss"]["curated"]
    subsets = {}
    for frac in args.fractions:
        name = f"oracle_top_{frac:g}"
        keep = np.sort(order[: max(1, int(round(frac * len(docs))))])
        shard_dir = work / "bound" / name / "corpus"
        shard_dir.mkdir(parents=True, exist_ok=True)
        shard = shard_dir / "shard-00000.parquet"
        pq.write_table(pool.take(pa.array(keep)), shard)
        tokens = prepare_tokens(acfg, tokenizer_path, [shard], work / "bound" / name / "tokens")
        run = tracker.start_run(name, tags={"crucible.stage": "ablate", "crucible.ablation_arm": name})
        trained = run_training(acfg, Path(tokens["index_path"]), work / "bound" / name / "train", tracking_uri, run, name)
        loss, _ = heldout_loss(acfg, Path(trained["checkpoints"][-1]), held)
        tracker.end_run(run)
        train_tokens = tokens["splits"]["train"]["tokens"]
        corpus = corpus_stats([str(shard)])
        subsets[name] = {"fraction_of_pool_docs": frac, "docs": corpus["docs"], "bytes": corpus["bytes"],
                         "by_source": corpus["by_source"], "train_tokens_available": train_tokens,
                         "epochs": round(trained["steps"] * ablation["token_budget"]["tokens_per_step"] / max(1, train_tokens), 3),
                         "heldout_loss": round(loss, 6), "relative_improvement_over_langid_only": round((la - loss) / la, 6)}
        print(f"{name:<18}{corpus['docs']:>6} docs {train_tokens:>10,} tokens  held-out {loss:.4f}  "
              f"({100 * (la - loss) / la:+.2f} % vs langid-only)", flush=True)
    best = max(s["relative_improvement_over_langid_only"] for s in subsets.values())
    out = {
        "benchmark": "ablation_bound",
        "config": args.config, "overrides": args.overrides,
        "method": "DSIR-style top-k selection of the langid-only pool towards WikiText-2 test "
                  "(hashed token unigrams+bigrams); same model, token budget, tokenizer and held-out text "
                  "(WikiText-2 valid) as the ablation arms",
        "target_text": Path(args.target).name,
        "ablation": {"heldout_loss": {"langid_only": la, "curated": lb},
                     "relative_improvement": ablation["relative_improvement"],
                     "target_improvement": ablation["target_improvement"],
                     "token_budget": ablation["token_budget"]},
        "pool_docs": len(docs),
        "subsets": subsets,
        "best_oracle_relative_improvement": best,
        "oracle_meets_target": best >= ablation["target_improvement"],
        "seconds": round(time.perf_counter() - t0, 1),
    }
    print(f"best oracle-guided subset: {100 * best:+.2f} % vs langid-only (target {100 * ablation['target_improvement']:.0f} %); "
          f"curated arm {100 * ablation['relative_improvement']:+.2f} %")
    write_result(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
