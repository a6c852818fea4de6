"""The deployment gate: a challenger is compared with the champion on one pinned evaluation set
(the yardstick), both scored in bits per byte, a tokenizer-independent metric, instead of
val_loss figures measured on different validation splits with different tokenizers.

The set (gate/yardstick.jsonl of the challenger's run, or the cycle's yardstick stage directory;
one {"part", "text"} per line, identified by its sha256) holds evenly spread held-out documents:
  old       the validation splits behind the champion: the token indexes it was trained on (for a
            continued model, every earlier cycle's), decoded with the champion's tokenizer,
  new       the validation split of the challenger's own data, decoded with its tokenizer,
  wikitext  WikiText-2 test pages (evaluate.wikitext), the suite's language-modelling task.
Byte-level BPE round-trips token ids to the exact text. Bits per byte of a part =
-(sum of natural-log likelihoods) / ln 2 / (UTF-8 bytes of its texts).

Promote only if the challenger improves on `new` by at least deploy.min_improvement and regresses
on `old` and `wikitext` by at most deploy.max_forgetting (bits per byte), and on the suite's
LAMBADA / HellaSwag accuracy (from both evaluation reports) by at most deploy.max_forgetting_acc:
the forgetting guard. The absolute threshold deploy.max_val_loss applies to every challenger.

Scores are kept on the registered versions as signed tags `yardstick.<sha256[:16]>.<part>`, so the
champion is scored once per set (every checkpoint of a run is gated on the same set); a score tag
that is unsigned or forged is not among the champion's verified tags, so it is scored again. The
champion's files are its registered checkpoint and tokenizer, verified against the registered
content hash; when they are gone, its registered copy is downloaded from MLflow and verified
against the hashes recorded at registration (`export_sha256`, `tokenizer_sha256`).
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import os
import uuid
from contextlib import contextmanager
from pathlib import Path

from tasks.core.layout import RunLayout
from tasks.core import fs
from tasks.core.signing import SignatureError
from tasks.core.storage import local_run_root, stored
from tasks.tokens.binfile import TokensChanged, listed_bytes, read_signed_index

log = logging.getLogger(__name__)

PARTS = ("old", "new", "wikitext")
ACCURACY = ("lambada_acc", "hellaswag_acc")


class YardstickChanged(ValueError):
    """The set file is not the one that was built (score's yardstick_sha256): it is refused."""


class UntrustedTokenIndex(TokensChanged, SignatureError):
    """A token index the stack cannot vouch for (unsigned or forged, not the hash a signed record holds,
    not the one the checkpoint was trained from): refused, the reason naming the remedy. A refusal of
    the data (the gate catches TokensChanged), never a failure of the stack's own signing key."""


class ChampionDataRefused(TokensChanged):
    """The champion's signed tags vouch for its token data, but the chain yields no "old" part (its index
    gone or replaced, a pool member gone or not the one its mix recorded): the gate refuses rather than
    drop its no-forgetting check on that data."""


UNSIGNED_INDEX_REMEDY = ("(a token index written before the stack signed them, or changed since: re-run the tokens "
                         "stage of that run, which writes it signed, or re-register the model from a run whose "
                         "index is signed)")


@contextmanager
def index_refusals():
    """Within it, a token index refused for its signature (SignatureError: unsigned, forged, not the
    vouched hash) becomes UntrustedTokenIndex naming the remedy, a refusal of that data; a problem with
    the stack's own signing key (missing, not private) is raised as it is first: the stack's failure,
    never one checkpoint's refusal."""
    from tasks.core.signing import signing_key

    signing_key()
    try:
        yield
    except SignatureError as e:
        raise UntrustedTokenIndex(f"{e} {UNSIGNED_INDEX_REMEDY}") from e


def _held_out(index_path: str | Path, tokenizer, limit: int, max_chars: int, trained: dict | None = None,
              vouched: str | None = None) -> list[str]:
    """Up to `limit` val documents of a token index, decoded; an index of an object-store run is read
    on the store. The index must be signed (UntrustedTokenIndex otherwise), or with `vouched` (the sha256
    a signed record holds for it: a champion's pool, maybe written before indexes were signed) hash to
    it: trust re-derived. Its val split and doc_starts must hash to what it records (TokensChanged
    otherwise): document starts swapped in would cut the set's texts elsewhere. `trained`: the
    challenger's signed checkpoint meta, whose index this must be (evaluate.val_tokens)."""
    import numpy as np

    from tasks.evaluate.evaluate import val_tokens
    from tasks.evaluate.suite import spread_indices

    at, options = stored(index_path)
    with index_refusals():
        if vouched:  # val_tokens' read, held to the vouched hash instead of a signature
            index, _ = read_signed_index(at, options, sha256=vouched)
            val = index["splits"]["val"]
            tokens = np.frombuffer(listed_bytes(index, at, "val", "path", options), count=val["tokens"],
                                   dtype=np.dtype(index["dtype"]).newbyteorder("<")) if val["tokens"] else None
        else:
            index, tokens = val_tokens(at, options, trained=trained)
    info = index["splits"]["val"]
    if not info["tokens"]:
        return []
    starts = np.load(io.BytesIO(listed_bytes(index, at, "val", "doc_starts", options)), allow_pickle=False)
    if starts.dtype != np.int64 or starts.ndim != 1 or not len(starts) or starts[0] != 0 \
            or np.any(np.diff(starts) < 0) or starts[-1] > info["tokens"]:
        raise TokensChanged(f"{info['doc_starts']} of {at}: not increasing int64 document starts from 0")
    ends = list(starts[1:]) + [info["tokens"]]
    texts = []
    for i in spread_indices(len(starts), limit):
        ids = [int(t) for t in tokens[int(starts[i]):int(ends[i])]]
        texts.append(tokenizer.decode(ids, skip_special_tokens=True)[:max_chars])
    return [t for t in texts if t.strip()]


def build_yardstick(cfg, out_path: str | Path, new_index: str | Path | None, new_tokenizer: str | Path | None,
                    pool: list[str | Path] | dict[str, str], pool_tokenizer, trained: dict | None = None) -> dict:
    """Write the evaluation set; returns {"path", "sha256", "parts": {part: documents}}. `trained`: the
    challenger's signed checkpoint meta: the "new" part must come from the index it was trained from.
    `pool`: the "old" part's token indexes, each signed, or as mix.vouched_pool gives them {index: the
    sha256 a signed chain holds for it} (an index without one must be signed)."""
    from tasks.evaluate.suite import load_wikitext_pages, spread_indices
    from tasks.tokenizer.bpe import load_tokenizer

    d = cfg.deploy
    parts: dict[str, list[str]] = {}
    vouched = pool if isinstance(pool, dict) else dict.fromkeys(pool)
    # an object-store run's index: read there
    vouched = {fs.location(str(p)): h for p, h in vouched.items() if fs.is_file(*stored(fs.location(str(p))))}
    if vouched and pool_tokenizer:
        # a path, or the champion's tokenizer already loaded from bytes checked against its signed hash
        tok = load_tokenizer(pool_tokenizer) if isinstance(pool_tokenizer, (str, Path)) else pool_tokenizer
        per_pool = max(1, d.yardstick_docs // len(vouched))
        parts["old"] = [t for p, h in vouched.items()
                        for t in _held_out(p, tok, per_pool, d.yardstick_max_chars, vouched=h or None)]
    if new_index and fs.is_file(*stored(new_index)) and new_tokenizer:
        parts["new"] = _held_out(new_index, load_tokenizer(*stored(new_tokenizer)), d.yardstick_docs,
                                 d.yardstick_max_chars, trained)
    wikitext = Path(cfg.resolve_uri(cfg.evaluate.wikitext.path))
    if cfg.evaluate.wikitext.enabled and wikitext.is_file():
        pages = load_wikitext_pages(wikitext)
        parts["wikitext"] = [pages[i][:d.yardstick_max_chars]
                             for i in spread_indices(len(pages), cfg.evaluate.wikitext.limit)]
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    data = "".join(json.dumps({"part": part, "text": text}, ensure_ascii=False) + "\n"
                   for part, texts in parts.items() for text in texts).encode("utf-8")
    tmp.write_bytes(data)
    tmp.replace(out_path)  # two gates of one run may build the same set at once
    # the hash of what was built, not of the file read back: score() holds the file to it
    return {"path": str(out_path), "sha256": hashlib.sha256(data).hexdigest(),
            "parts": {k: len(v) for k, v in parts.items() if v}}


def score(checkpoint: str | Path, tokenizer_path: str | Path, yardstick: str | Path, batch_size: int = 16,
          expected_tree_sha256: str | None = None, yardstick_sha256: str | None = None) -> dict:
    """{part: bits per byte} of one model on the set (`expected_tree_sha256`: a verified copy's hash).
    With `yardstick_sha256` (the gate's: build_yardstick's hash), a set file that no longer has it is
    refused: the run directory's gate/ folder is writable, and a set swapped after it was built
    would score the challenger on other text than the champion's scores kept for that hash."""
    from tasks.evaluate.scoring import LMScorer

    data = Path(yardstick).read_bytes()  # read once: what is checked is what is scored
    if yardstick_sha256 is not None and hashlib.sha256(data).hexdigest() != yardstick_sha256:
        log.warning("refused: the yardstick %s is not the set that was built (sha256 %s)", yardstick,
                    yardstick_sha256[:12])
        raise YardstickChanged(f"refused: the yardstick {yardstick} changed since it was built (its sha256 is not "
                               f"{yardstick_sha256})")
    scorer = LMScorer.from_files(checkpoint, tokenizer_path, batch_size=batch_size,
                                 expected_tree_sha256=expected_tree_sha256)
    rows = [json.loads(line) for line in data.decode("utf-8").splitlines()]
    out = {}
    for part in dict.fromkeys(r["part"] for r in rows):
        texts = [r["text"] for r in rows if r["part"] == part]
        ll = sum(s.logprob for s in scorer.loglikelihood_rolling(texts))
        n_bytes = sum(len(t.encode("utf-8")) for t in texts)
        out[part] = -ll / n_bytes / math.log(2) if n_bytes else float("nan")
    return out


def decide(d, challenger: dict, champion: dict, challenger_acc: dict, champion_acc: dict) -> dict:
    """The gate on the yardstick: {"passed", "reason", "checks": [...]}; `d` is the deploy section."""
    if "new" not in challenger or "new" not in champion:
        return {"passed": False, "checks": [],
                "reason": "yardstick refuses: there is no held-out text of the challenger's own data to show an "
                          "improvement on (its checkpoint is not in a run directory with a token index)"}
    gain = champion["new"] - challenger["new"]
    checks = [{"check": "new data improves", "part": "new", "challenger": challenger["new"],
               "champion": champion["new"], "ok": gain > 0 and gain >= d.min_improvement,
               "rule": f"champion - challenger >= {d.min_improvement:g} and > 0 (bits per byte)"}]
    for part in ("old", "wikitext"):
        if part in challenger and part in champion:
            checks.append({"check": "no forgetting", "part": part, "challenger": challenger[part],
                           "champion": champion[part],
                           "ok": challenger[part] - champion[part] <= d.max_forgetting,
                           "rule": f"challenger - champion <= {d.max_forgetting:g} (bits per byte)"})
    for metric in ACCURACY:
        if challenger_acc.get(metric) is not None and champion_acc.get(metric) is not None:
            checks.append({"check": "no forgetting", "part": metric, "challenger": challenger_acc[metric],
                           "champion": champion_acc[metric],
                           "ok": champion_acc[metric] - challenger_acc[metric] <= d.max_forgetting_acc,
                           "rule": f"champion - challenger <= {d.max_forgetting_acc:g} (accuracy)"})
    failed = [k for k in checks if not k["ok"]]
    describe = "; ".join(f"{k['part']} {k['challenger']:.4f} vs champion {k['champion']:.4f}"
                         for k in (failed or checks))
    return {"passed": not failed, "checks": checks,
            "reason": (f"yardstick: {describe}" if not failed else
                       f"yardstick refuses: {describe} ({', '.join(k['rule'] for k in failed)})")}


def score_tags(set_sha256: str, bits_per_byte: dict) -> dict:
    """Model-version tags holding a model's scores on one set (reused while the set is unchanged)."""
    return {f"yardstick.{set_sha256[:16]}.{part}": f"{v:.6f}" for part, v in bits_per_byte.items()}


def scores_from_tags(tags: dict, built: dict) -> dict | None:
    """A version's scores on this set, from its tags; None unless every part of the set is there."""
    prefix = f"yardstick.{built['sha256'][:16]}."
    try:
        got = {part: float(tags[prefix + part]) for part in built["parts"]}
    except (KeyError, ValueError):
        return None
    return got or None


def trained_on(checkpoint: str | Path) -> Path | str | None:
    """The token index a checkpoint was trained on (a continued cycle's mix), else its run's."""
    from tasks.train.checkpoint import read_meta

    # a checkpoint of an object-store run: its meta read on the store, which names the index there. A
    # local file first (the pool of a continued cycle is read from local indexes), else the store's object
    index = read_meta(*stored(checkpoint)).get("tokens_index")
    own = RunLayout.of_checkpoint(checkpoint).tokens_index if RunLayout.is_run_checkpoint(checkpoint) else None
    candidates = [fs.location(index)] if index else []
    candidates += [own] if own is not None else []
    local = next((c for c in candidates if not fs.is_remote(c) and Path(c).is_file()), None)
    return local or next((stored(c)[0] for c in candidates if fs.is_file(*stored(c))), None)


def champion_tokenizer(tags: dict):
    """The champion's tokenizer (it decodes the replayed "old" part), from the file its verified
    tags name (in its run directory, or an object-store run's object read there), read once and used
    only when those bytes hash to the signed tokenizer_sha256; None otherwise, logged (the set then
    has no "old" part)."""
    from tasks.tokenizer.bpe import load_tokenizer

    if not tags.get("tokenizer"):
        return None
    try:
        return load_tokenizer(*stored(fs.location(tags["tokenizer"])), expected_sha256=tags.get("tokenizer_sha256") or "")
    except (OSError, ValueError) as e:
        log.warning("the champion's tokenizer cannot be used, the yardstick has no 'old' part: %s", e)
        return None


def gate_dir(cfg, checkpoint: str | Path) -> Path:
    """Where a checkpoint's gate files go: its run's gate/ folder, else run_root/.gate/."""
    if RunLayout.is_run_checkpoint(checkpoint):
        return RunLayout.of_checkpoint(checkpoint).run_dir / "gate"
    return local_run_root(cfg) / ".gate"


def champion_pool(tags: dict, pool: list[str | Path] | dict[str, str] | None = None) -> list | dict:
    """The "old" part's token indexes: `pool` (the flow's, from vouched_pool) or vouched_pool of the
    champion's verified tags. When those tags hold a signed data.tokens_index_sha256, the chain must give
    every member (ChampionDataRefused otherwise): deleting or replacing the champion's index, or a member
    of its pool, would otherwise drop the no-forgetting check on its data without a word."""
    from tasks.continued.mix import MixError, vouched_pool

    signed, index = tags.get("data.tokens_index_sha256"), tags.get("data.tokens_index")
    try:
        pool = pool if pool is not None else vouched_pool(index, signed or "")
    except MixError as e:
        raise ChampionDataRefused(f"yardstick refuses: the champion's data cannot be checked for forgetting: "
                                  f"{e}") from e
    if not signed:
        return pool
    if not pool:
        raise ChampionDataRefused(f"yardstick refuses: the champion's token index {index} is gone or is not the one its "
                                  "signed data.tokens_index_sha256 holds, so the no-forgetting check on its data cannot "
                                  "run (restore that index, or re-register the champion)")
    gone = [str(p) for p in pool if not fs.is_file(*stored(fs.location(str(p))))]
    if gone:
        raise ChampionDataRefused(f"yardstick refuses: token indexes the champion was trained on are gone, so the "
                                  f"no-forgetting check on them cannot run (restore them): {gone}")
    return pool


def against_champion(cfg, tracking_uri: str, evaluation: dict, tokenizer_path: str | Path, champion: dict,
                     out_dir: str | Path | None = None, new_index: str | Path | None = None,
                     pool: list[str | Path] | dict[str, str] | None = None) -> dict:
    """Score the challenger (evaluation["checkpoint"]) and the champion (a get_champion dict) on
    one set and decide. new_index / pool default to what each model was trained on (pool: signed
    indexes, or build_yardstick's {index: vouched sha256}). Returns
    {"set", "challenger", "champion", "decision"}, also written to <out_dir>/gate-step-N.json."""
    from tasks.deploy.registry import registered_files, set_version_tags
    from tasks.train.checkpoint import read_meta

    d, name = cfg.deploy, cfg.deploy.model_name
    ckpt = evaluation["checkpoint"]
    out_dir = Path(out_dir or gate_dir(cfg, ckpt))
    new_index = new_index if new_index is not None else trained_on(ckpt)
    # the champion's tags are verified ones (get_champion); its token index must still hash to the signed value
    tags = champion["tags"]
    # {index: sha256 the champion's signed tag chain holds}: an index from before signing is taken so
    pool = champion_pool(tags, pool)
    # the challenger's "new" part from the index it was trained from (its signed meta records that index's hash)
    trained = read_meta(*stored(ckpt))
    built = build_yardstick(cfg, out_dir / "yardstick.jsonl", new_index, tokenizer_path, pool, champion_tokenizer(tags),
                            trained)
    batch = cfg.evaluate.task_batch_size
    # the bytes the signed report attests, not whatever the run's folder holds now (another run's
    # genuine checkpoint and manifest swapped in after the evaluation would pass a manifest check)
    challenger_bpb = score(ckpt, tokenizer_path, built["path"], batch,
                           expected_tree_sha256=evaluation.get("checkpoint_sha256"), yardstick_sha256=built["sha256"])
    champion_bpb = scores_from_tags(champion["tags"], built)
    scored = "reused from its registry tags"
    if champion_bpb is None:
        # downloaded registered copies are kept beside the runs
        c_ckpt, c_tok, copy_hash = registered_files(tracking_uri, name, champion,
                                                  local_run_root(cfg) / ".champions")
        champion_bpb = score(c_ckpt, c_tok, built["path"], batch, expected_tree_sha256=copy_hash,
                             yardstick_sha256=built["sha256"])
        set_version_tags(tracking_uri, name, champion["version"], score_tags(built["sha256"], champion_bpb))
        scored = f"scored from {c_ckpt}"
    challenger_acc = {m: (evaluation.get("task_metrics") or {}).get(m) for m in ACCURACY}
    champion_acc = {m: float(champion["tags"][f"eval.{m}"]) for m in ACCURACY if f"eval.{m}" in champion["tags"]}
    decision = decide(d, challenger_bpb, champion_bpb, challenger_acc, champion_acc)
    # an accuracy is not re-measured here: a forged or unsigned one (left out of the verified tags)
    # would silently drop its forgetting check, so the gate refuses instead
    if forged := [f"eval.{m}" for m in ACCURACY if f"eval.{m}" in champion.get("untrusted_tags", ())]:
        decision = {**decision, "passed": False,
                    "reason": f"yardstick refuses: the champion's {', '.join(forged)} tags are unsigned or forged, "
                              "so its accuracy cannot be compared (re-register or re-evaluate the champion)"}
    data = {"set": built, "challenger": {"checkpoint": str(ckpt), "bits_per_byte": challenger_bpb},
            "champion": {"version": champion["version"], "content_hash": champion["tags"].get("content_hash"),
                         "checkpoint": champion["tags"].get("checkpoint"), "bits_per_byte": champion_bpb,
                         "scores": scored},
            "decision": decision}
    step = evaluation.get("step")
    from tasks.deploy.gate import write_gate_record

    write_gate_record(out_dir / f"gate-step-{int(step) if step is not None else 'unknown'}.json", data)  # signed
    return data


def gate_evaluation(cfg, tracking_uri: str, evaluation: dict, tokenizer_path: str | Path,
                    champion: dict | None = None) -> tuple[dict, dict | None]:
    """The deploy gate for an evaluated checkpoint against the champion of now:
    (decision {"passed", "reason", ...}, yardstick or None). With no champion only the absolute
    threshold applies; a yardstick already in the evaluation is reused when it was scored
    against this champion. A champion that cannot be scored refuses the challenger (the reason
    says why) rather than falling back to comparing val_loss across runs."""
    from tasks.deploy.gate import gate
    from tasks.deploy.registry import UnverifiedModel
    from tasks.train.checkpoint import UnverifiedCheckpoint

    absolute = gate(cfg.deploy, evaluation)
    if not absolute["passed"] or champion is None:
        return absolute, None
    yardstick = evaluation.get("yardstick")
    if not (yardstick and yardstick["champion"]["version"] == champion["version"]):
        try:
            yardstick = against_champion(cfg, tracking_uri, evaluation, tokenizer_path, champion)
        except (UnverifiedModel, UnverifiedCheckpoint) as e:
            return {"passed": False, "reason": f"the champion (version {champion['version']}) cannot be scored on "
                                               f"the yardstick: {e}"}, None
        # never scored on a set someone else wrote (an untrusted index: UntrustedTokenIndex); a failure of
        # the stack's own signing key is no verdict on this checkpoint: raised
        except (YardstickChanged, TokensChanged) as e:
            return {"passed": False, "reason": str(e)}, None
    return yardstick["decision"], yardstick


def gate_at_evaluation(cfg, tracking_uri: str, report: dict, tokenizer_path: str | Path) -> tuple[dict, dict | None]:
    """The verdict written into a checkpoint's evaluation report (the checkpoint table shows it;
    the triggered deploy-model run follows only a pass): the gate against the champion of now.
    A continued cycle's checkpoints are deployed only by its own gate_and_deploy."""
    from tasks.deploy.registry import get_champion

    if cfg.train.init_from:
        return {"passed": False, "reason": "continued-pretraining checkpoint: deployed only by its cycle's "
                                           f"gate_and_deploy (val_loss {report['val_loss']:.4f})"}, None
    return gate_evaluation(cfg, tracking_uri, report, tokenizer_path, get_champion(tracking_uri, cfg.deploy.model_name))


def yardstick_rows(checks: list[dict]) -> list[dict]:
    """The gate's checks (decision["checks"]) as table rows (the eval table artifact)."""
    return [{"check": k["check"], "part": k["part"], "challenger": round(k["challenger"], 4),
             "champion": round(k["champion"], 4), "passed": k["ok"], "rule": k["rule"]} for k in checks]
