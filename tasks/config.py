"""One pydantic config tree for the whole pipeline, loaded from YAML.

Every stage reads its own section; `load_config` validates the whole tree before anything
starts, so a bad value fails fast with its field path (e.g. `train.max_steps`).
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

# Where ../shared/data lives; a user points this at their own files.
DATA_ROOT_ENV = "CRUCIBLE_DATA_ROOT"
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATA_ROOT = REPO_ROOT.parent / "shared" / "data"


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SourceConfig(Section):
    """One entry of the source registry."""

    name: str = Field(pattern=r"^[a-z0-9_\-]+$")
    uri: str  # glob, relative to data_root unless absolute or a URL
    format: Literal["warc", "wet", "jsonl", "parquet", "text"]
    licence: str
    provenance: str
    max_docs: int | None = Field(default=None, gt=0)  # cap per source, for quick runs
    opt_out_domains: list[str] = []
    pii_policy: Literal["redact", "keep"] = "redact"
    mixture_weight: float = Field(default=1.0, ge=0)


class RayConfig(Section):
    address: str | None = None  # None: start a local Ray; "auto" or "ray://host:10001": attach
    num_cpus: int | None = Field(default=None, gt=0)


class IngestConfig(Section):
    extractor: Literal["trafilatura"] = "trafilatura"
    favour_precision: bool = True
    max_doc_bytes: int = Field(default=1_000_000, gt=0)
    shard_docs: int = Field(default=2000, gt=0)  # documents per output Parquet shard
    normalise_nfc: bool = True


class LangIdConfig(Section):
    enabled: bool = True
    languages: dict[str, float] = {"en": 0.65}  # language -> minimum score


class GopherQualityConfig(Section):
    enabled: bool = True
    min_doc_words: int = 50
    max_doc_words: int = 100_000
    min_avg_word_length: float = 3
    max_avg_word_length: float = 10
    max_symbol_word_ratio: float = 0.1
    max_bullet_lines_ratio: float = 0.9
    max_ellipsis_lines_ratio: float = 0.3
    max_non_alpha_words_ratio: float = 0.8  # minimum fraction of words with a letter
    min_stop_words: int = 2
    stop_words: list[str] = ["the", "be", "to", "of", "and", "that", "have", "with"]


class GopherRepetitionConfig(Section):
    enabled: bool = True
    dup_para_frac: float = 0.3
    dup_para_char_frac: float = 0.2
    dup_line_frac: float = 0.3
    dup_line_char_frac: float = 0.2
    top_n_grams: dict[int, float] = {2: 0.2, 3: 0.18, 4: 0.16}
    dup_n_grams: dict[int, float] = {5: 0.15, 6: 0.14, 7: 0.13, 8: 0.12, 9: 0.11, 10: 0.10}


class C4Config(Section):
    enabled: bool = True
    max_word_length: int = 1000
    remove_citations: bool = True
    filter_no_terminal_punct: bool = False  # FineWeb keeps it off
    min_words_per_line: int = 3
    filter_javascript: bool = True
    filter_policy: bool = True
    filter_lorem_ipsum: bool = True
    filter_curly_bracket: bool = True
    min_num_sentences: int = 5


class FineWebConfig(Section):
    enabled: bool = True
    line_punct_thr: float = 0.12
    short_line_thr: float = 0.67
    short_line_length: int = 30
    char_duplicates_ratio: float = 0.01
    new_line_ratio: float = 0.3


class MinHashConfig(Section):
    enabled: bool = True
    ngram: int = Field(default=5, gt=0)
    bands: int = Field(default=14, gt=0)
    rows: int = Field(default=8, gt=0)
    seed: int = 1


class DedupConfig(Section):
    exact: bool = True
    minhash: MinHashConfig = MinHashConfig()


class CurateConfig(Section):
    langid: LangIdConfig = LangIdConfig()
    gopher_quality: GopherQualityConfig = GopherQualityConfig()
    gopher_repetition: GopherRepetitionConfig = GopherRepetitionConfig()
    c4: C4Config = C4Config()
    fineweb: FineWebConfig = FineWebConfig()
    dedup: DedupConfig = DedupConfig()


class TokenizerConfig(Section):
    vocab_size: int = Field(default=4096, ge=300)
    min_frequency: int = Field(default=2, ge=1)
    bos_token: str = "<|bos|>"
    eos_token: str = "<|endoftext|>"
    pad_token: str = "<|pad|>"
    batch_docs: int = Field(default=1000, gt=0)  # documents per batch fed to the BPE trainer
    roundtrip_sample_docs: int = Field(default=200, ge=0)  # docs checked for decode(encode(x)) == x


class TokensConfig(Section):
    val_fraction: float = Field(default=0.05, gt=0, lt=1)
    seed: int = 1234
    batch_docs: int = Field(default=512, gt=0)  # documents per encode_batch call


class ModelConfig(Section):
    n_layer: int = Field(default=4, gt=0)
    n_head: int = Field(default=4, gt=0)
    d_model: int = Field(default=128, gt=0)
    seq_len: int = Field(default=128, gt=0)
    mlp_ratio: float = Field(default=8 / 3, gt=0)
    rope_theta: float = 10000.0
    dropout: float = Field(default=0.0, ge=0, lt=1)

    @model_validator(mode="after")
    def _heads_divide(self) -> "ModelConfig":
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        if (self.d_model // self.n_head) % 2:
            raise ValueError("head dimension must be even for RoPE")
        return self


class TrainConfig(Section):
    nnodes: int = Field(default=1, gt=0)
    nproc_per_node: int = Field(default=2, gt=0)
    backend: Literal["gloo", "nccl"] = "gloo"
    device: Literal["cpu", "cuda"] = "cpu"
    max_steps: int = Field(default=200, gt=0)
    micro_batch_size: int = Field(default=8, gt=0)  # sequences per process per step
    lr: float = Field(default=3e-3, gt=0)
    min_lr: float = Field(default=3e-4, ge=0)
    warmup_steps: int = Field(default=20, ge=0)
    weight_decay: float = Field(default=0.1, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = Field(default=1.0, gt=0)
    checkpoint_every: int = Field(default=100, gt=0)
    log_every: int = Field(default=10, gt=0)
    seed: int = 1337
    threads_per_proc: int = Field(default=1, gt=0)
    rdzv_endpoint: str | None = None  # multi-node: "host:port"
    rdzv_id: str | None = None  # multi-node: job id shared by all nodes (default: the run name)
    grad_accum_steps: int = Field(default=1, gt=0)  # micro-batches per optimizer step
    resume: bool = False  # continue from the newest checkpoint in the output directory

    @model_validator(mode="after")
    def _lr_order(self) -> "TrainConfig":
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr ({self.min_lr}) must not exceed lr ({self.lr})")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError("nnodes > 1 needs rdzv_endpoint (host:port of the rendezvous)")
        return self


class EvaluateConfig(Section):
    max_val_batches: int = Field(default=20, gt=0)
    batch_size: int = Field(default=8, gt=0)
    prompts: list[str] = ["The Linux kernel", "Debian is", "In Python, a list"]
    sample_tokens: int = Field(default=32, gt=0)
    temperature: float = Field(default=0.8, ge=0)  # 0: greedy
    top_k: int | None = Field(default=50, gt=0)
    seed: int = 0  # sampling seed, so reports are reproducible


class DeployConfig(Section):
    model_name: str = "crucible-tiny"
    max_val_loss: float = Field(default=8.0, gt=0)  # gate: absolute threshold
    min_improvement: float = Field(default=0.0, ge=0)  # gate: better than champion by at least δ
    host: str = "127.0.0.1"
    port: int = Field(default=8600, gt=0, lt=65536)


class StackConfig(Section):
    state_dir: str = ".crucible"  # relative to the working directory unless absolute
    host: str = "127.0.0.1"
    prefect_port: int = Field(default=4200, gt=0, lt=65536)
    mlflow_port: int = Field(default=5000, gt=0, lt=65536)


class LineageConfig(Section):
    namespace: str = "crucible"
    producer: str = "https://github.com/crucible-ml/crucible"


class PipelineConfig(Section):
    name: str = Field(pattern=r"^[A-Za-z0-9_\-]+$")
    data_root: str = str(DEFAULT_DATA_ROOT)
    run_root: str = "runs"  # run directories go under here
    sources: list[SourceConfig] = Field(min_length=1)
    ray: RayConfig = RayConfig()
    ingest: IngestConfig = IngestConfig()
    curate: CurateConfig = CurateConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()
    tokens: TokensConfig = TokensConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    evaluate: EvaluateConfig = EvaluateConfig()
    deploy: DeployConfig = DeployConfig()
    stack: StackConfig = StackConfig()
    lineage: LineageConfig = LineageConfig()

    @field_validator("sources")
    @classmethod
    def _unique_sources(cls, sources: list[SourceConfig]) -> list[SourceConfig]:
        names = [s.name for s in sources]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate source names: {dupes}")
        return sources

    def resolve_uri(self, uri: str) -> str:
        """A source URI relative to data_root becomes absolute; URLs and absolute paths stay."""
        if re.match(r"^[a-z][a-z0-9+.\-]*://", uri) or os.path.isabs(uri):
            return uri
        return str(Path(self.data_root) / uri)


class ConfigError(ValueError):
    """A config that does not validate; the message names each bad field by its path."""


def _parse_scalar(text: str) -> Any:
    return yaml.safe_load(text) if text != "" else ""


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply `a.b.c=value` overrides (value parsed as YAML) to a raw config dict."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected KEY=VALUE, e.g. train.max_steps=200")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        node = raw
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {key}: {part} is not a section")
            node = child
        node[parts[-1]] = _parse_scalar(value)
    return raw


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"]) or "<root>"
        lines.append(f"  {path}: {e['msg']} (got {e.get('input')!r})"[:300])
    return "invalid config:\n" + "\n".join(lines)


def load_config(path: str | Path, overrides: list[str] | None = None) -> PipelineConfig:
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path}: top level must be a mapping")
    raw = apply_overrides(raw, overrides or [])
    if os.environ.get(DATA_ROOT_ENV):
        raw["data_root"] = os.environ[DATA_ROOT_ENV]
    try:
        return PipelineConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_format_errors(e)) from None
