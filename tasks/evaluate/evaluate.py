"""Evaluate a checkpoint: validation loss / perplexity, sample generations and the task suite.

Val windows are deterministic: non-overlapping windows of seq_len + 1 tokens spread evenly over
the val split (all of them when they fit in max_val_batches x batch_size). Each prompt is sampled
with a generator seeded by cfg.evaluate.seed, so the same checkpoint and config give the same report
and a prompt's sample does not depend on the other prompts.

The task suite (tasks.evaluate.suite: WikiText-2, LAMBADA, HellaSwag, calibration; each switched
and sized in cfg.evaluate) adds report["tasks"][name]; with cfg.evaluate.reference enabled, the
same LAMBADA / HellaSwag subsets are scored through an OpenAI-compatible endpoint
(tasks.evaluate.reference) and report["reference"] holds both side by side.
"""
from __future__ import annotations

import hashlib
import logging
import math
import time
from pathlib import Path

import numpy as np
import torch

from tasks.config import PipelineConfig
from tasks.core import fs
from tasks.tokenizer.bpe import read_tokenizer
# TokensChanged and listed_bytes are the token index format's (tasks/tokens/binfile.py); named here for their callers
from tasks.tokens.binfile import TokensChanged, listed_bytes, read_signed_index  # noqa: F401
from tasks.train.checkpoint import load_verified_model, trained_index_problem

log = logging.getLogger(__name__)


def val_window_starts(n_tokens: int, window: int, max_windows: int) -> np.ndarray:
    """Start offsets of up to max_windows windows of `window` tokens, evenly spread, no overlap."""
    n_fit = n_tokens // window
    if n_fit == 0:
        return np.zeros(0, dtype=np.int64)
    if n_fit <= max_windows:
        return np.arange(n_fit, dtype=np.int64) * window
    slots = np.linspace(0, n_fit - 1, max_windows).round().astype(np.int64)  # distinct: n_fit > max
    return slots * window


@torch.no_grad()
def val_loss(model, tokens: np.ndarray, seq_len: int, batch_size: int, max_batches: int) -> tuple[float, int]:
    """Mean next-token cross-entropy over the chosen windows; returns (loss, tokens scored)."""
    if len(tokens) < 2:
        raise ValueError(f"the val split has {len(tokens)} tokens: nothing to evaluate")
    seq_len = min(seq_len, len(tokens) - 1)  # a val split shorter than one window still counts
    starts = val_window_starts(len(tokens), seq_len + 1, max_batches * batch_size)
    total, count = 0.0, 0
    for i in range(0, len(starts), batch_size):
        w = torch.from_numpy(np.stack([np.asarray(tokens[s:s + seq_len + 1], dtype=np.int64)
                                       for s in starts[i:i + batch_size]]))
        _, loss = model(w[:, :-1], w[:, 1:])
        n = w[:, 1:].numel()
        total += loss.item() * n
        count += n
    return total / count, count


def val_tokens(tokens_index: Path | str, storage_options: dict | None = None, trained: dict | None = None
               ) -> tuple[dict, np.ndarray]:
    """(the token index, its val split's tokens), local or on a store (read where it lives). The index
    must carry the stack's signature (SignatureError otherwise): a rewritten one could name other
    tokens with hashes to match. The val split is read once, whole, and held to the sha256 the index
    records: what is checked is what is scored. The train split is never read. `trained`: the signed
    meta of the checkpoint to be scored, whose index this must be (TokensChanged otherwise: another
    run's genuine signed index copied in; tasks.train.checkpoint.trained_index_problem)."""
    index, raw = read_signed_index(tokens_index, storage_options)
    if trained is not None and (problem := trained_index_problem(trained, hashlib.sha256(raw).hexdigest(), index)):
        raise TokensChanged(f"token index {tokens_index}: {problem}")
    val = index["splits"]["val"]
    dtype = np.dtype(index["dtype"]).newbyteorder("<")
    if not val["tokens"]:
        return index, np.zeros(0, dtype=dtype)
    data = listed_bytes(index, tokens_index, "val", "path", storage_options)
    return index, np.frombuffer(data, dtype=dtype, count=val["tokens"])


def evaluate_checkpoint(cfg: PipelineConfig, ckpt_dir: Path | str, tokenizer_path: Path | str,
                        tokens_index: Path | str, out_path: Path, tracking_uri: str | None = None,
                        run_id: str | None = None) -> dict:
    """Score the checkpoint on the val split and sample completions of cfg.evaluate.prompts.

    The checkpoint, tokenizer and token index are local paths or, for an object-store run_root,
    its objects' URIs (read through fsspec with cfg.storage.options; the checkpoint is downloaded
    to a temporary folder and verified there, as every load from a store is).

    Writes the JSON report to out_path and returns it: {"step", "val_loss", "perplexity",
    "samples": [{"prompt", "completion"}], "report_path", "checkpoint", "val_tokens",
    "tasks": {name: {...}}, "task_metrics": {flat name: value}, "reference" (if enabled), ...}.
    With run_id, val_loss, perplexity and the task metrics (wikitext_word_perplexity, lambada_acc,
    hellaswag_acc_norm, hellaswag_ece, ...; reference_* for the reference model) are logged to
    that MLflow run at the checkpoint's step.
    """
    ecfg = cfg.evaluate
    t0 = time.perf_counter()
    prev_threads = torch.get_num_threads()
    if ecfg.threads:
        torch.set_num_threads(ecfg.threads)
    try:
        report = _evaluate(cfg, ckpt_dir, tokenizer_path, tokens_index, out_path, tracking_uri, run_id)
    finally:
        torch.set_num_threads(prev_threads)
    report["seconds"] = round(time.perf_counter() - t0, 3)
    return report


def _evaluate(cfg: PipelineConfig, ckpt_dir: Path | str, tokenizer_path: Path | str, tokens_index: Path | str,
              out_path: Path, tracking_uri: str | None, run_id: str | None) -> dict:
    ecfg, options = cfg.evaluate, cfg.storage.options
    ckpt_dir = fs.canonical(ckpt_dir)
    # the hash of the verified copy scored: the store's objects, hashed again later, could be others
    model, meta, checkpoint_sha256 = load_verified_model(ckpt_dir, storage_options=options)
    tokenizer_path, tokens_index = fs.location(tokenizer_path), fs.location(tokens_index)
    # read once: checked against the checkpoint's tokenizer and recorded as the bytes parsed
    tok, tok_sha = read_tokenizer(tokenizer_path, options, meta.get("tokenizer_sha256") or None)
    index, val = val_tokens(tokens_index, options, trained=meta)
    if index["vocab_size"] != model.cfg.vocab_size:
        raise ValueError(f"tokens vocab {index['vocab_size']} != checkpoint vocab {model.cfg.vocab_size}")

    loss, n_scored = val_loss(model, val, model.cfg.seq_len, ecfg.batch_size, ecfg.max_val_batches)

    eos_id = meta.get("eos_id", index["eos_id"])
    samples = []
    for prompt in ecfg.prompts:
        # seeded per prompt: a sample depends only on (checkpoint, prompt, sampling settings)
        gen = torch.Generator().manual_seed(ecfg.seed)
        ids = tok.encode(prompt, add_special_tokens=False).ids or [eos_id]  # empty prompt: start after EOS
        out = model.generate(torch.tensor([ids], dtype=torch.long), ecfg.sample_tokens,
                             temperature=ecfg.temperature, top_k=ecfg.top_k, eos_id=eos_id, generator=gen)
        new = [t for t in out[0, len(ids):].tolist() if t != eos_id]
        samples.append({"prompt": prompt, "completion": tok.decode(new, skip_special_tokens=True)})

    from tasks.evaluate.scoring import LMScorer
    from tasks.evaluate.suite import run_suite

    suite = run_suite(cfg, LMScorer(model, tok, eos_id, ecfg.task_batch_size))
    log.info("evaluate: task suite of step %s in %s s: %s", meta["step"], suite["seconds"], suite["metrics"])
    reference = None
    if ecfg.reference.enabled:
        from tasks.evaluate.reference import EndpointError, compare_with_reference

        try:
            reference = compare_with_reference(cfg, suite["tasks"])
        except EndpointError as e:  # the comparison is extra: the checkpoint's own report still stands
            log.warning("evaluate: reference model comparison failed: %s", e)
            reference = {"base_url": ecfg.reference.base_url, "model": ecfg.reference.model, "error": str(e),
                         "metrics": {}}

    report = {
        "step": meta["step"],
        "val_loss": round(loss, 6),
        "perplexity": round(math.exp(loss), 4),
        "val_tokens": n_scored,
        "samples": samples,
        "checkpoint": str(ckpt_dir),
        "run_name": meta.get("run_name"),
        "run_id": meta.get("run_id"),
        "tokenizer_sha256": tok_sha,
        "val_sha256": index["splits"]["val"].get("sha256"),
        "sampling": {"temperature": ecfg.temperature, "top_k": ecfg.top_k, "seed": ecfg.seed,
                     "max_new_tokens": ecfg.sample_tokens},
        "tasks": _finite(suite["tasks"]),
        "task_metrics": _finite(suite["metrics"]),
    }
    if reference is not None:
        report["reference"] = _finite(reference)
    # what was evaluated, recorded on the training run too: deploy-model checks a claim against it
    report["checkpoint_sha256"] = checkpoint_sha256
    out_path = Path(out_path).resolve()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    report["report_path"] = str(out_path)
    write_report(report)

    if run_id:
        from mlflow import MlflowClient
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        values = {"val_loss": report["val_loss"], "perplexity": report["perplexity"], **report["task_metrics"]}
        if reference is not None:
            values.update({f"reference_{k}": v for k, v in report["reference"]["metrics"].items()})
        from mlflow.entities import RunTag

        from tasks.deploy.registry import signed_run_tags

        # signed like every run tag the pipeline reads back (deploy-model compares its claim with it)
        tags = signed_run_tags(run_id, {eval_hash_tag(report["step"]): report["checkpoint_sha256"]})
        MlflowClient(tracking_uri=tracking_uri).log_batch(run_id, metrics=[
            Metric(name, float(v), ts, report["step"]) for name, v in values.items() if v is not None],
            tags=[RunTag(k, v) for k, v in tags.items()])
    return report


# Reports are signed (tasks/core/signing.py): the deploy flow acts on the gate verdict and yardstick a
# report carries, so one that a run-directory writer forged or edited must be refused, never trusted
REPORT_PURPOSE = "eval-report"


def write_report(report: dict) -> Path:
    """Write an evaluation report, signed, to report["report_path"] (readable JSON; the signature is
    one more field)."""
    from tasks.core.signing import write_signed

    return write_signed(report["report_path"], report, REPORT_PURPOSE)


def read_report(path: str | Path) -> dict:
    """A signed evaluation report; SignatureError (logged as refused) if it is unsigned or forged."""
    from tasks.core.signing import read_signed

    return read_signed(path, REPORT_PURPOSE)


def eval_hash_tag(step: int) -> str:
    """The training run's tag holding the tree hash of the checkpoint evaluated at `step`."""
    return f"eval.step-{int(step)}.checkpoint_sha256"


def _finite(obj):
    """A copy for JSON: floats rounded to 6 decimals, NaN and infinities as None."""
    if isinstance(obj, float):
        return round(obj, 6) if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj
