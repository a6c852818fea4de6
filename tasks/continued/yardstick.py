"""The fixed yardstick a continued-pretraining cycle is gated on: one pinned evaluation set scored
for the champion and the challenger alike, in bits per byte (tokenizer-independent).

The set (gate/yardstick.jsonl in the cycle's run directory, one {"part", "text"} per line,
identified by its sha256) holds evenly spread held-out documents of three parts:
  old       the validation splits of every earlier cycle's token shards (the replay pool),
  new       the validation split of this cycle's new data,
  wikitext  WikiText-2 test pages (evaluate.wikitext), the suite's language-modelling task;
held-out documents are decoded from their token ids, which byte-level BPE round-trips exactly.
Bits per byte of a part = -(sum of natural-log likelihoods) / ln 2 / (UTF-8 bytes of its texts).

Promote only if the challenger improves on `new` by at least continue.min_improvement and
regresses on `old` and on `wikitext` by at most continue.max_forgetting (bits per byte), and on
the suite's LAMBADA / HellaSwag accuracy (from both evaluation reports) by at most
continue.max_forgetting_acc: the forgetting guard.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from tasks.core.hashing import sha256_file

PARTS = ("old", "new", "wikitext")
ACCURACY = ("lambada_acc", "hellaswag_acc")


def _held_out(index_path: str | Path, tokenizer, limit: int, max_chars: int) -> list[str]:
    from tasks.evaluate.suite import spread_indices
    from tasks.tokens.binfile import load_index, open_doc_starts, open_split

    info = load_index(index_path)["splits"]["val"]
    if not info["tokens"]:
        return []
    tokens, starts = open_split(index_path, "val"), open_doc_starts(index_path, "val")
    ends = list(starts[1:]) + [info["tokens"]]
    texts = []
    for i in spread_indices(len(starts), limit):
        ids = [int(t) for t in tokens[int(starts[i]):int(ends[i])]]
        texts.append(tokenizer.decode(ids, skip_special_tokens=True)[:max_chars])
    return [t for t in texts if t.strip()]


def build_yardstick(cfg, tokenizer_path: str | Path, new_index: str | Path, pool: list[str | Path],
                    out_path: str | Path) -> dict:
    """Write the evaluation set; returns {"path", "sha256", "parts": {part: documents}}."""
    from tasks.evaluate.suite import load_wikitext_pages, spread_indices
    from tasks.tokenizer.bpe import load_tokenizer

    c = cfg.continue_
    tok = load_tokenizer(tokenizer_path)
    per_pool = max(1, c.yardstick_docs // max(1, len(pool)))
    parts = {"old": [t for p in pool for t in _held_out(p, tok, per_pool, c.yardstick_max_chars)],
             "new": _held_out(new_index, tok, c.yardstick_docs, c.yardstick_max_chars)}
    wikitext = Path(cfg.resolve_uri(cfg.evaluate.wikitext.path))
    if cfg.evaluate.wikitext.enabled and wikitext.is_file():
        pages = load_wikitext_pages(wikitext)
        parts["wikitext"] = [pages[i][:c.yardstick_max_chars]
                             for i in spread_indices(len(pages), cfg.evaluate.wikitext.limit)]
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with open(out_path, "w", encoding="utf-8") as f:
        for part, texts in parts.items():
            for text in texts:
                f.write(json.dumps({"part": part, "text": text}, ensure_ascii=False) + "\n")
    return {"path": str(out_path), "sha256": sha256_file(out_path), "parts": {k: len(v) for k, v in parts.items()}}


def score(checkpoint: str | Path, tokenizer_path: str | Path, yardstick: str | Path, batch_size: int = 16) -> dict:
    """{part: bits per byte} of one model on the set."""
    from tasks.evaluate.scoring import LMScorer

    scorer = LMScorer.from_files(checkpoint, tokenizer_path, batch_size=batch_size)
    rows = [json.loads(line) for line in Path(yardstick).read_text(encoding="utf-8").splitlines()]
    out = {}
    for part in dict.fromkeys(r["part"] for r in rows):
        texts = [r["text"] for r in rows if r["part"] == part]
        ll = sum(s.logprob for s in scorer.loglikelihood_rolling(texts))
        n_bytes = sum(len(t.encode("utf-8")) for t in texts)
        out[part] = -ll / n_bytes / math.log(2) if n_bytes else float("nan")
    return out


def decide(c, challenger: dict, champion: dict, challenger_acc: dict, champion_acc: dict) -> dict:
    """The gate on the yardstick: {"passed", "reason", "checks": [...]}; `c` is the continue section."""
    checks = []
    if "new" in challenger and "new" in champion:
        gain = champion["new"] - challenger["new"]
        checks.append({"check": "new data improves", "part": "new", "challenger": challenger["new"],
                       "champion": champion["new"], "ok": gain > 0 and gain >= c.min_improvement,
                       "rule": f"champion - challenger >= {c.min_improvement:g} and > 0 (bits per byte)"})
    for part in ("old", "wikitext"):
        if part in challenger and part in champion:
            checks.append({"check": "no forgetting", "part": part, "challenger": challenger[part],
                           "champion": champion[part],
                           "ok": challenger[part] - champion[part] <= c.max_forgetting,
                           "rule": f"challenger - champion <= {c.max_forgetting:g} (bits per byte)"})
    for metric in ACCURACY:
        if challenger_acc.get(metric) is not None and champion_acc.get(metric) is not None:
            checks.append({"check": "no forgetting", "part": metric, "challenger": challenger_acc[metric],
                           "champion": champion_acc[metric],
                           "ok": champion_acc[metric] - challenger_acc[metric] <= c.max_forgetting_acc,
                           "rule": f"champion - challenger <= {c.max_forgetting_acc:g} (accuracy)"})
    failed = [k for k in checks if not k["ok"]]
    if not checks:
        return {"passed": False, "reason": "the yardstick has nothing both models were scored on", "checks": checks}
    describe = "; ".join(f"{k['part']} {k['challenger']:.4f} vs champion {k['champion']:.4f}"
                         for k in (failed or checks))
    return {"passed": not failed, "checks": checks,
            "reason": (f"yardstick: {describe}" if not failed else
                       f"yardstick refuses: {describe} ({', '.join(k['rule'] for k in failed)})")}
