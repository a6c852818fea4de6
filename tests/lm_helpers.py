"""Shared helpers for the tokenizer / tokens / train / evaluate tests (imported, not a conftest).

The corpus is small but real: Linux kernel RST docs and paragraphs of a Gutenberg book from
shared/data/text, written as Parquet shards in a temporary directory. Expensive artifacts
(tokenizer, token files, one 2-process training run) are built once per pytest session under
the session's base temp dir and reused by every test file that asks for them. The deploy and
serving tests (and benchmarks/serving.py) use a randomly initialised model instead
(sample_tokenizer, random_checkpoint).
"""
from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from infra.settings import CrucibleConfig
from tasks.config import DATA_ROOT_ENV, DEFAULT_DATA_ROOT, PipelineConfig

DATA_DIR = Path(os.environ.get(DATA_ROOT_ENV) or DEFAULT_DATA_ROOT)
TEXT_DIR = DATA_DIR / "text"
EVAL_DIR = DATA_DIR / "eval"


def corpus_rows(n_linux: int = 150, n_nonascii: int = 20, gutenberg_book: str = "carroll-alice",
                max_chars: int = 4000) -> list[dict]:
    """Linux docs (the first n_linux, plus the first n_nonascii that hold non-ASCII text) and the
    paragraphs (10 lines each) of one Gutenberg book. Deterministic."""
    rows, nonascii = [], 0
    with gzip.open(TEXT_DIR / "linux-doc-rst.jsonl.gz", "rt", encoding="utf-8") as f:
        for i, line in enumerate(f):
            d = json.loads(line)
            has_nonascii = any(ord(c) > 127 for c in d["text"])
            if i < n_linux or (has_nonascii and nonascii < n_nonascii):
                nonascii += has_nonascii
                rows.append({"id": f"linux/{d['id']}", "source": "linux-doc", "text": d["text"][:max_chars]})
            if i >= n_linux and nonascii >= n_nonascii:
                break
    lines = (TEXT_DIR / "gutenberg" / f"{gutenberg_book}.txt").read_text(encoding="utf-8").splitlines()
    for k in range(0, len(lines), 10):
        rows.append({"id": f"gutenberg/{gutenberg_book}/{k // 10}", "source": "gutenberg",
                     "text": "\n".join(lines[k:k + 10])})
    return rows


def write_shards(rows: list[dict], out_dir: Path, n_shards: int = 3) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for s in range(n_shards):
        path = out_dir / f"shard-{s:05d}.parquet"
        pq.write_table(pa.Table.from_pylist(rows[s::n_shards]), path)
        paths.append(path)
    return paths


def tiny_cfg(**sections) -> PipelineConfig:
    """A config for fast tests: 512-token vocab, 2-layer 64-wide model, 20 steps on 2 ranks."""
    raw = {
        "name": "test-lm",
        "sources": [{"name": "test", "uri": "text/x", "format": "text", "licence": "test",
                     "provenance": "test"}],
        "tokenizer": {"vocab_size": 512, "min_frequency": 2},
        "tokens": {"val_fraction": 0.1, "seed": 7, "ray": False},  # Ray path: test_tokens.py
        "model": {"n_layer": 2, "n_head": 4, "d_model": 64, "seq_len": 64},
        "train": {"nproc_per_node": 2, "max_steps": 20, "micro_batch_size": 8, "lr": 3e-3,
                  "min_lr": 3e-4, "warmup_steps": 5, "checkpoint_every": 10, "log_every": 5,
                  "peak_flops_per_s": 1e11},  # so MFU is logged
        "evaluate": {"max_val_batches": 4, "batch_size": 4, "sample_tokens": 8,
                     "prompts": ["The Linux kernel", "Alice was"],
                     # small suite subsets keep stage tests fast; tests/test_eval_suite.py covers the suite
                     "wikitext": {"limit": 1}, "lambada": {"limit": 20}, "hellaswag": {"limit": 10}},
    }
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return CrucibleConfig.model_validate(raw)  # the whole file: stack= and lineage= sections too


def _cached(marker: Path, build) -> dict:
    if marker.is_file():
        return json.loads(marker.read_text())
    result = build()
    marker.write_text(json.dumps(result))
    return result


def corpus_shards(base: Path) -> list[Path]:
    base = base / "corpus"
    done = _cached(base.parent / "corpus.json",
                   lambda: {"shards": [str(p) for p in write_shards(corpus_rows(), base)]})
    return [Path(p) for p in done["shards"]]


def tokenizer_artifact(base: Path) -> dict:
    from tasks.tokenizer import train_tokenizer

    shards = corpus_shards(base)
    return _cached(base / "tokenizer.json.done",
                   lambda: train_tokenizer(tiny_cfg(), shards, base / "tokenizer"))


def tokens_artifact(base: Path) -> dict:
    from tasks.tokens import prepare_tokens

    tok = tokenizer_artifact(base)
    shards = corpus_shards(base)
    return _cached(base / "tokens.done",
                   lambda: prepare_tokens(tiny_cfg(), Path(tok["path"]), shards, base / "tokens"))


def training_run(base: Path) -> dict:
    """One real 2-process torchrun run of tiny_cfg() (20 steps, checkpoints at 10 and 20), logging
    to a fresh MLflow run in a file store under `base` (returned as result["mlflow"])."""
    from mlflow import MlflowClient

    from tasks.train import run_training

    tokens = tokens_artifact(base)

    def build() -> dict:
        old = os.environ.get("MLFLOW_ALLOW_FILE_STORE")
        os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # a file store keeps the test fast (no DB setup)
        try:
            uri = (base / "mlruns").resolve().as_uri()
            client = MlflowClient(tracking_uri=uri)
            run_id = client.create_run(client.create_experiment("test-lm")).info.run_id
            result = run_training(tiny_cfg(), Path(tokens["index_path"]), base / "train", uri, run_id, "test-run")
        finally:
            if old is None:
                os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)
            else:
                os.environ["MLFLOW_ALLOW_FILE_STORE"] = old
        return {**result, "mlflow": {"tracking_uri": uri, "run_id": run_id}}

    return _cached(base / "train.done", build)


# ------------------------------------------------------------------ a random model for deploy/serving

SAMPLE_TEXT = ("The Linux kernel is a free and open-source Unix-like kernel. Debian is a free operating system. "
               "In Python, a list is a mutable sequence. ") * 40


def sample_tokenizer(path: Path, vocab_size: int = 320) -> Path:
    """A byte-level BPE tokenizer trained on SAMPLE_TEXT, with the pipeline's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|bos|>", "<|endoftext|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([SAMPLE_TEXT], trainer=trainer)
    tok.save(str(path))
    return path


def random_checkpoint(out_dir: Path, tokenizer: Path, step: int, seed: int, run_name: str = "test",
                      meta_extra: dict | None = None, init=None, **model_options) -> Path:
    """A randomly initialised GPT for `tokenizer` (2 layers, 2 heads, width 32, seq_len 32 unless
    model_options say otherwise), saved as step `step` with tasks.train's checkpoint code;
    init(model), when given, changes the weights first (e.g. sharpen_moe)."""
    import torch
    from tokenizers import Tokenizer

    from tasks.core.hashing import sha256_file
    from tasks.train.checkpoint import apply_retention, save_checkpoint
    from tasks.train.model import GPT, GPTConfig

    vocab = Tokenizer.from_file(str(tokenizer)).get_vocab_size()
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=vocab, **{"n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 32, **model_options})
    model = GPT(cfg)
    if init is not None:
        init(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    meta = {"model": cfg.to_dict(), "eos_id": 1, "tokenizer_sha256": sha256_file(tokenizer), "run_name": run_name,
            **(meta_extra or {})}
    ckpt = save_checkpoint(model, opt, step, out_dir, meta)
    apply_retention(out_dir, ckpt, None)  # the run's manifest vouches for it, as the trainer's does
    return ckpt


# an MoE of 2 layers, the second sparse: 4 experts, top-2, one shared expert (dense + sparse layers)
TINY_MOE = {"n_experts": 4, "top_k": 2, "n_shared_experts": 1, "every_n_layers": 2, "expert_hidden": 48}


def sharpen_moe(model) -> None:
    """Make a random MoE route like a trained one: decisive router scores, distinct experts and a
    nonzero selection bias (training moves expert_bias; a fresh model's is zero), so that a test
    comparing two implementations fails if either one routes differently."""
    import torch

    from tasks.train.moe import MoE

    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, MoE):
                m.router.weight.normal_(0.0, 0.5, generator=g)
                for w in (m.experts.w1, m.experts.w2, m.experts.w3):
                    w.normal_(0.0, 0.1, generator=g)
                m.expert_bias.copy_(torch.randn(m.n_experts, generator=g) * 0.1)


def train_on_nodes(cfg_for_rank, tokens_index, out_dir, run_name: str, nodes: int = 2) -> dict:
    """`run_training` of each node rank in a thread of its own (the nodes of a c10d rendezvous on this
    machine): {rank: result}; raises if a node failed or is still running after 300 s."""
    import threading

    from tasks.train import run_training

    results, errors = {}, []

    def node(rank: int) -> None:
        try:
            results[rank] = run_training(cfg_for_rank(rank), tokens_index, out_dir, None, None, run_name)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=node, args=(r,)) for r in range(nodes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a node is still running after 300 s"
    assert not errors, errors
    return results
