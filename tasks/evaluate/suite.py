r"""The evaluation task suite: WikiText-2 perplexity, LAMBADA, HellaSwag and calibration.

Each task follows the lm-evaluation-harness task of the same name (see tasks.evaluate.scoring for
how text is scored), on the copies under data_root/eval:

wikitext   The test split of WikiText-2 as PyTorch's example ships it: the *tokenized* text with
           `<unk>` (not wikitext-2-raw), so the numbers are not comparable with published
           wikitext-2-raw results. The file is cut into documents at its top-level headings
           (" = Title = "), 62 in the test split like lm-eval's wikitext_document_level. Each page
           is scored whole with `loglikelihood_rolling` (stride: see scoring.rolling_chunks). By
           default the page text is scored as it is, without lm-eval's wikitext detokenizer
           (`detokenize: true` applies it). Metrics, summed over pages:
             word_perplexity  = exp(-sum loglik / sum words), words = len(re.split(r"\s+", page))
                                counted on the original page text, exactly as lm-eval does
             token_perplexity = exp(-sum loglik / sum tokens) (this model's tokenizer)
             byte_perplexity, bits_per_byte over the UTF-8 bytes of the original page
lambada    OpenAI's LAMBADA test file (lm-eval `lambada_openai`): context = text without its last
           space-separated word, target = " " + that word.
             acc        fraction of items whose target tokens are all the argmax (greedy) choice
             perplexity exp(-mean over items of log P(target | context)), lm-eval's aggregation
             target_token_perplexity  exp(-sum loglik / sum target tokens)
hellaswag  The validation split (converted copy: activity_label, ctx, label, endings). Query =
           preprocess(activity_label + ": " + ctx), choices = preprocess(ending), scored as
           (query, " " + choice), with lm-eval's preprocess (WikiHow bracket markers removed).
           The copy has no ctx_a / ctx_b, so lm-eval's capitalisation of ctx_b is not applied.
             acc       argmax of the choices' log-likelihoods is the label
             acc_norm  argmax of log-likelihood / len(choice) in characters (lm-eval's acc_norm)
calibration Expected calibration error of the HellaSwag predictions: confidence = max of the
           softmax over the 4 choices' log-likelihoods, correct = that choice is the label;
           ECE = sum over equal-width confidence bins of (bin size / n) x |accuracy - mean confidence|.

Subsets: `limit` items are taken at evenly spread indices of the file (deterministic, and spread
over the whole file rather than its first section); None takes every item.
"""
from __future__ import annotations

import json
import logging
import math
import re
import time
from functools import lru_cache
from pathlib import Path

import numpy as np

from tasks.evaluate.scoring import LMScorer, perplexity

log = logging.getLogger(__name__)

TASKS = ("wikitext", "lambada", "hellaswag", "calibration")


# ------------------------------------------------------------------------------------ data

def spread_indices(n: int, limit: int | None) -> list[int]:
    """`limit` distinct indices evenly spread over range(n), first and last included; all if None."""
    if limit is None or limit >= n:
        return list(range(n))
    if limit == 1:
        return [0]
    return [int(i) for i in np.linspace(0, n - 1, limit).round().astype(np.int64)]


def _file_key(path: str | Path) -> tuple[str, int, int]:
    p = Path(path)
    st = p.stat()
    return str(p.resolve()), st.st_mtime_ns, st.st_size


_HEADING = re.compile(r"^ = [^=].* = $")


@lru_cache(maxsize=4)
def _wikitext_pages(key: tuple[str, int, int]) -> tuple[str, ...]:
    pages: list[list[str]] = []
    with open(key[0], encoding="utf-8", newline="") as f:
        for line in f:
            if _HEADING.match(line.rstrip("\n")) or not pages:
                pages.append([])
            pages[-1].append(line)
    return tuple("".join(p) for p in pages if "".join(p).strip())


def load_wikitext_pages(path: str | Path) -> list[str]:
    """The documents of a WikiText file: cut before each top-level heading line (" = Title = ")."""
    return list(_wikitext_pages(_file_key(path)))


@lru_cache(maxsize=8)
def _jsonl(key: tuple[str, int, int]) -> tuple[dict, ...]:
    with open(key[0], encoding="utf-8") as f:
        return tuple(json.loads(line) for line in f if line.strip())


def load_lambada(path: str | Path, limit: int | None = None) -> list[dict]:
    """[{"index", "context", "target"}] with lm-eval's lambada_openai split of "text"."""
    rows = _jsonl(_file_key(path))
    out = []
    for i in spread_indices(len(rows), limit):
        words = rows[i]["text"].split(" ")
        out.append({"index": i, "context": " ".join(words[:-1]), "target": " " + words[-1]})
    return out


def hellaswag_preprocess(text: str) -> str:
    """lm-eval's hellaswag preprocess: strip, WikiHow " [title]" -> ". ", drop [markers], "  " -> " "."""
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def load_hellaswag(path: str | Path, limit: int | None = None) -> list[dict]:
    """[{"index", "query", "choices", "gold"}] from the converted validation file."""
    rows = _jsonl(_file_key(path))
    out = []
    for i in spread_indices(len(rows), limit):
        d = rows[i]
        out.append({"index": i, "query": hellaswag_preprocess(d["activity_label"] + ": " + d["ctx"]),
                    "choices": [hellaswag_preprocess(e) for e in d["endings"]], "gold": int(d["label"])})
    return out


def wikitext_detokenizer(string: str) -> str:
    """lm-eval's wikitext detokenizer (tasks/wikitext/preprocess_wikitext.py)."""
    string = string.replace("s '", "s'")
    string = re.sub(r"/' [0-9]/", r"/'[0-9]/", string)
    string = string.replace(" @-@ ", "-")
    string = string.replace(" @,@ ", ",")
    string = string.replace(" @.@ ", ".")
    string = string.replace(" : ", ": ")
    string = string.replace(" ; ", "; ")
    string = string.replace(" . ", ". ")
    string = string.replace(" ! ", "! ")
    string = string.replace(" ? ", "? ")
    string = string.replace(" , ", ", ")
    string = re.sub(r"\(\s*([^\)]*?)\s*\)", r"(\1)", string)
    string = re.sub(r"\[\s*([^\]]*?)\s*\]", r"[\1]", string)
    string = re.sub(r"{\s*([^}]*?)\s*}", r"{\1}", string)
    string = re.sub(r"\"\s*([^\"]*?)\s*\"", r'"\1"', string)
    string = re.sub(r"'\s*([^']*?)\s*'", r"'\1'", string)
    string = string.replace("= = = =", "====")
    string = string.replace("= = =", "===")
    string = string.replace("= =", "==")
    string = string.replace(" " + chr(176) + " ", chr(176))
    string = string.replace(" \n", "\n")
    string = string.replace("\n ", "\n")
    string = string.replace(" N ", " 1 ")
    string = string.replace(" 's", "'s")
    return string


def count_words(text: str) -> int:
    """lm-eval's word count for perplexity tasks."""
    return len(re.split(r"\s+", text))


# --------------------------------------------------------------------------------- metrics

def expected_calibration_error(confidence, correct, n_bins: int = 10) -> tuple[float, list[dict]]:
    """ECE with equal-width bins over [0, 1] (bin i holds confidences in (i/n, (i+1)/n], bin 0 also
    0); returns (ece, [{"lo", "hi", "count", "accuracy", "confidence"} per non-empty bin])."""
    conf = np.asarray(confidence, dtype=np.float64)
    ok = np.asarray(correct, dtype=np.float64)
    if conf.size == 0:
        return float("nan"), []
    if np.any((conf < 0) | (conf > 1)):
        raise ValueError("confidences must lie in [0, 1]")
    bins = np.clip(np.ceil(conf * n_bins).astype(np.int64) - 1, 0, n_bins - 1)
    ece, table = 0.0, []
    for b in range(n_bins):
        m = bins == b
        if not m.any():
            continue
        acc, cf = float(ok[m].mean()), float(conf[m].mean())
        ece += m.sum() / conf.size * abs(acc - cf)
        table.append({"lo": b / n_bins, "hi": (b + 1) / n_bins, "count": int(m.sum()),
                      "accuracy": round(acc, 6), "confidence": round(cf, 6)})
    return float(ece), table


def softmax(x) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def multiple_choice_metrics(items: list[dict], lls: list[list[float]], n_bins: int = 10) -> dict:
    """acc, acc_norm (per character), and calibration of the softmax over choices' log-likelihoods."""
    acc, acc_norm, conf, correct = [], [], [], []
    for item, ll in zip(items, lls):
        ll = np.asarray(ll, dtype=np.float64)
        lengths = np.array([float(max(len(c), 1)) for c in item["choices"]])
        pred = int(np.argmax(ll))
        acc.append(pred == item["gold"])
        acc_norm.append(int(np.argmax(ll / lengths)) == item["gold"])
        p = softmax(ll)
        conf.append(float(p.max()))
        correct.append(pred == item["gold"])
    ece, table = expected_calibration_error(conf, correct, n_bins)
    return {"acc": float(np.mean(acc)) if acc else float("nan"),
            "acc_norm": float(np.mean(acc_norm)) if acc_norm else float("nan"),
            "ece": ece, "mean_confidence": float(np.mean(conf)) if conf else float("nan"),
            "reliability": table, "n": len(items)}


# ----------------------------------------------------------------------------------- tasks

def eval_wikitext(scorer: LMScorer, pages: list[str], stride: int | None = None,
                  detokenize: bool = False) -> dict:
    texts = [wikitext_detokenizer(p) if detokenize else p for p in pages]
    scored = scorer.loglikelihood_rolling(texts, stride)
    ll = sum(s.logprob for s in scored)
    tokens = sum(s.n_tokens for s in scored)
    words = sum(count_words(p) for p in pages)
    n_bytes = sum(len(p.encode("utf-8")) for p in pages)
    return {"word_perplexity": perplexity(ll, words), "token_perplexity": perplexity(ll, tokens),
            "byte_perplexity": perplexity(ll, n_bytes),
            "bits_per_byte": -ll / n_bytes / math.log(2) if n_bytes else float("nan"),
            "loglikelihood": ll, "documents": len(pages), "words": words, "tokens": tokens,
            "bytes": n_bytes, "stride": stride or scorer.seq_len, "detokenize": detokenize}


def eval_lambada(scorer: LMScorer, items: list[dict]) -> dict:
    scored = scorer.loglikelihood([(it["context"], it["target"]) for it in items])
    n = len(scored)
    lls = [s.logprob for s in scored]
    tokens = sum(s.n_tokens for s in scored)
    return {"acc": sum(s.is_greedy for s in scored) / n if n else float("nan"),
            "perplexity": perplexity(sum(lls), n),
            "target_token_perplexity": perplexity(sum(lls), tokens),
            "n": n, "target_tokens": tokens}


def score_hellaswag(scorer: LMScorer, items: list[dict]) -> list[list[float]]:
    pairs = [(it["query"], " " + c) for it in items for c in it["choices"]]
    flat = [s.logprob for s in scorer.loglikelihood(pairs)]
    out, k = [], 0
    for it in items:
        out.append(flat[k:k + len(it["choices"])])
        k += len(it["choices"])
    return out


def run_suite(cfg, scorer: LMScorer) -> dict:
    """Run the tasks enabled in cfg.evaluate; returns {"tasks": {name: {...}}, "metrics": {flat name:
    value}, "seconds": {name: s}}. A task whose data file is missing raises, or with
    evaluate.on_missing = "skip" is reported as {"skipped": reason}."""
    ecfg = cfg.evaluate
    tasks: dict[str, dict] = {}
    metrics: dict[str, float] = {}
    seconds: dict[str, float] = {}

    def data(name: str, path: str) -> Path | None:
        p = Path(cfg.resolve_uri(path))
        if p.is_file():
            return p
        if ecfg.on_missing == "skip":
            log.warning("evaluate: %s data %s not found: task skipped", name, p)
            tasks[name] = {"skipped": f"data file not found: {p}"}
            return None
        raise FileNotFoundError(f"evaluate.{name}: data file not found: {p} "
                                f"(set evaluate.{name}.enabled=false or evaluate.on_missing=skip)")

    if ecfg.wikitext.enabled and (p := data("wikitext", ecfg.wikitext.path)):
        t0 = time.perf_counter()
        all_pages = load_wikitext_pages(p)
        pages = [all_pages[i] for i in spread_indices(len(all_pages), ecfg.wikitext.limit)]
        r = eval_wikitext(scorer, pages, ecfg.wikitext.stride, ecfg.wikitext.detokenize)
        tasks["wikitext"] = {"data": str(p), **r}
        for k in ("word_perplexity", "token_perplexity", "byte_perplexity", "bits_per_byte"):
            metrics[f"wikitext_{k}"] = r[k]
        seconds["wikitext"] = time.perf_counter() - t0

    if ecfg.lambada.enabled and (p := data("lambada", ecfg.lambada.path)):
        t0 = time.perf_counter()
        r = eval_lambada(scorer, load_lambada(p, ecfg.lambada.limit))
        tasks["lambada"] = {"data": str(p), **r}
        for k in ("acc", "perplexity"):
            metrics[f"lambada_{k}"] = r[k]
        seconds["lambada"] = time.perf_counter() - t0

    if ecfg.hellaswag.enabled and (p := data("hellaswag", ecfg.hellaswag.path)):
        t0 = time.perf_counter()
        items = load_hellaswag(p, ecfg.hellaswag.limit)
        mc = multiple_choice_metrics(items, score_hellaswag(scorer, items), ecfg.calibration.bins)
        tasks["hellaswag"] = {"data": str(p), "acc": mc["acc"], "acc_norm": mc["acc_norm"], "n": mc["n"]}
        metrics["hellaswag_acc"], metrics["hellaswag_acc_norm"] = mc["acc"], mc["acc_norm"]
        if ecfg.calibration.enabled:
            tasks["calibration"] = {"hellaswag": {"ece": mc["ece"], "bins": ecfg.calibration.bins,
                                                  "mean_confidence": mc["mean_confidence"],
                                                  "accuracy": mc["acc"], "reliability": mc["reliability"],
                                                  "n": mc["n"]}}
            metrics["hellaswag_ece"] = mc["ece"]
        seconds["hellaswag"] = time.perf_counter() - t0
    elif ecfg.calibration.enabled:
        tasks["calibration"] = {"skipped": "no multiple-choice task enabled (calibration uses hellaswag)"}

    return {"tasks": tasks, "metrics": metrics, "seconds": {k: round(v, 3) for k, v in seconds.items()}}
