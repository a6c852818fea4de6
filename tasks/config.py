"""The stage layer's pydantic config tree, loaded from YAML.

Every stage receives the sections its `run` signature names (tasks/core/stage.py); `load_config`
validates the whole tree before anything starts, so a bad value fails fast with its field path
(e.g. `train.max_steps`). The same YAML file also holds the stack's sections (INFRA_SECTIONS: its
ports, databases, Ray cluster and lineage service), which infra/settings.py owns and validates.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator,
                      model_validator)

from tasks.core.constants import REPO_ROOT

# Where ../shared/data lives; a user points this at their own files.
DATA_ROOT_ENV = "CRUCIBLE_DATA_ROOT"
DEFAULT_DATA_ROOT = REPO_ROOT.parent / "shared" / "data"


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


# Sections of the same YAML file that the stack owns (infra/settings.py validates them): the stage
# layer neither reads nor checks them, so a PipelineConfig validated from the whole file leaves them out
INFRA_SECTIONS = ("stack", "lineage")


class SourceConfig(Section):
    """One entry of the source registry."""

    name: str = Field(pattern=r"^[a-z0-9_\-]+$")
    uri: str  # path/glob relative to data_root unless absolute, or file://, http(s)://, s3:// (extra `s3`)
    format: Literal["warc", "wet", "jsonl", "parquet", "text"]
    licence: str
    provenance: str
    max_docs: int | None = Field(default=None, gt=0)  # cap per source, for quick runs
    opt_out_domains: list[str] = []
    opt_out_url_patterns: list[str] = []  # regexes searched in the URL; a match drops the record "opt_out"
    pii_policy: Literal["redact", "keep"] = "redact"
    # multiplies the source's train tokens when token shards are built (0 drops it; tasks/tokens/mixture.py)
    mixture_weight: float = Field(default=1.0, ge=0)
    retention: str = ""  # retention note: how long the raw and derived data may be kept, and why
    # the exact files to read instead of expanding `uri` (a continued-pretraining cycle sets it to
    # the new files the data ledger found; each must be one `uri` names)
    files: list[str] | None = None
    # Options of the source's fsspec file system (s3fs for s3://: endpoint_url, anon, key, secret,
    # token, client_kwargs, default_block_size, ...). A value "${NAME}" is read from the environment
    # where the file is opened. Credentials may only be given that way, so the config (logged to
    # MLflow, lineage, the dataset card, run directories) never holds a secret.
    storage_options: dict[str, Any] = {}

    @field_validator("storage_options")
    @classmethod
    def _secrets_from_env(cls, v: dict[str, Any]) -> dict[str, Any]:
        bad = literal_secret_options(v)
        if bad:
            raise ValueError(f"storage_options {', '.join(bad)}: credentials must come from the environment: "
                             "write \"${ENV_VAR}\" (read when the file is opened), or leave them out and use "
                             "the standard AWS variables / credential chain")
        return v


# "${NAME}": an environment variable, resolved where a source file is opened (tasks.core.fs)
ENV_REF = re.compile(r"^\$\{([A-Za-z_][A-Za-z0-9_]*)\}$")
# option names that hold credentials (s3fs key/secret/token, client_kwargs aws_*_key*, passwords,
# HTTP Authorization headers); camelCase names are matched on their snake_case form
_SECRET_OPTION = re.compile(r"(^|_)(key|key_id|secret|token|password|passwd|credentials?|authorization|auth)$"
                            r"|secret|password|token|credential")


def literal_secret_options(options: dict[str, Any], prefix: str = "") -> list[str]:
    """Paths of credential options in `options` (nested dicts too) whose value is not "${ENV_VAR}"."""
    bad = []
    for name, value in options.items():
        path = f"{prefix}{name}"
        if isinstance(value, dict):
            bad += literal_secret_options(value, path + ".")
        elif value is not None and _SECRET_OPTION.search(re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", str(name)).lower()) \
                and not (isinstance(value, str) and ENV_REF.match(value)):
            bad.append(path)
    return bad


class RayConfig(Section):
    address: str | None = None  # None: start a local Ray; "auto" or "ray://host:10001": attach
    num_cpus: int | None = Field(default=None, gt=0)


class IngestConfig(Section):
    # HTML main-content extractor (tasks/ingest/extract.py); the README's "Extraction" gives the
    # measured speed and agreement behind the default
    extractor: Literal["trafilatura", "resiliparse"] = "resiliparse"
    favour_precision: bool = True
    max_doc_bytes: int = Field(default=1_000_000, gt=0)
    # at most this many documents per output Parquet shard (a job's documents are cut into shards of
    # this many, its last one shorter: shards follow the jobs, their concatenation is the corpus order)
    shard_docs: int = Field(default=2000, gt=0)
    # hash partitions of the document ids for duplicate-id detection: each job writes its ids into
    # this many files, one Ray task per partition resolves them, holding ~60 B per document of its
    # partition (measured: row, 16-byte digest and size as Parquet columns, the job index, the sort's
    # permutation). 0: one partition per `id_partition_bytes` of source files (their sizes at planning),
    # so a task's memory follows this setting, not the corpus. At most 65535 (a uint16 partition number)
    id_partitions: int = Field(default=0, ge=0, le=65535)
    # source bytes per id partition when `id_partitions` is 0 (a capped source counts at most 200 per
    # document of its cap). Assumes >= 200 source bytes per document (a compressed WARC response is
    # ~10 KB, a compressed JSONL line of web text ~1 KB): then a task holds <= 5.4 M documents, ~320 MB
    # at the default
    id_partition_bytes: int = Field(default=1 << 30, gt=0)
    normalise_nfc: bool = True
    normalise_whitespace: bool = True  # collapse runs of spaces, strip lines, at most one blank line
    extract_metadata: bool = True  # page date via htmldate (+ trafilatura's title); off: <title> and WARC-Date
    max_record_bytes: int = Field(default=10_000_000, gt=0)  # raw payload/line cap, quarantined above
    # a compressed JSONL file that inflates more than this (decompressed / compressed bytes, beyond an
    # allowance of this times max_record_bytes, so one oversized line is skipped) is a decompression
    # bomb: quarantined with the bytes not read, reading resumes at the next gzip member / zstd frame.
    # Text compresses 3-10x; a page of zeros 1000x
    max_compression_ratio: float = Field(default=100.0, gt=1)
    resume: bool = True  # reuse finished per-file jobs (sha256-verified parts) and a complete output


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
    # what "words" are for that ratio: "tokens" as datatrove (punctuation marks count as words
    # without a letter, so punctuated prose can fall below 0.8) or "whitespace" as the Gopher paper
    alpha_words: Literal["tokens", "whitespace"] = "tokens"
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
    line_punct_exclude_zero: bool = False  # True: a doc with no punctuated line passes that rule


class MinHashConfig(Section):
    enabled: bool = True
    ngram: int = Field(default=5, gt=0)
    # LSH banding of the bands x rows = 112 signature values. 28 x 4 makes a pair a candidate with
    # p = 1-(1-s^4)^28: 0.9995 at Jaccard 0.7, 0.98 at 0.6 (FineWeb's 14 x 8: 0.57 at 0.7, its 50 %
    # point at 0.685); the many low-similarity candidates this adds (0.84 at 0.5) are cut by
    # `verify`'s exact Jaccard, so the cut is a sharp one at verify_threshold instead of 14 x 8's
    # soft S-curve (benchmarks/curate_vs_datatrove.py: recall 0.93 vs 0.76, fewer false drops)
    bands: int = Field(default=28, gt=0)
    rows: int = Field(default=4, gt=0)
    seed: int = 1
    # datasketch permutation scheme the signatures match: "affine32" (its default since 2.0.0)
    # or "legacy" (Mersenne-prime universal hash of datasketch < 2.0)
    scheme: Literal["affine32", "legacy"] = "affine32"
    # join an LSH candidate pair only if its exact shingle Jaccard >= verify_threshold (the texts
    # are read back in the clustering's tasks); 0.7: 14 x 8's 50 % point, and the representative check's
    verify: bool = True
    verify_threshold: float = Field(default=0.7, ge=0, le=1)
    # a cluster member is dropped only if its Jaccard to the cluster's kept document reaches this
    # (exact with verify, else estimated from the signatures); the others are re-clustered, so a
    # chain A~B~C never drops C for A (tasks.dedup.cluster; benchmarks/dedup_quality.py chose 0.7)
    representative_threshold: float = Field(default=0.7, ge=0, le=1)
    batch_shingles: int = Field(default=16384, gt=0)  # shingles hashed per vectorised batch
    # shingle hash: "fast" (word hashes combined, `tasks.dedup.minhash.fast_hash32`) or "sha1"
    # (datasketch's default sha1_hash32); datasketch gives equal values with hashfunc= either one
    hash: Literal["fast", "sha1"] = "fast"
    # clustering: "local" (in-process union-find), "ray" (band keys spilled to Parquet partitions,
    # distributed connected components: tasks.dedup.cluster) or "auto" (ray from ray_min_docs)
    clustering: Literal["auto", "local", "ray"] = "auto"
    ray_min_docs: int = Field(default=200_000, gt=0)
    partitions: int = Field(default=0, ge=0, le=65535)  # band-key partitions (uint16 ids); 0: from the corpus size
    # which document of a cluster is kept: the first in corpus order, or the highest
    # `quality_field` score (ties and documents without a score: first seen)
    survivor: Literal["first_seen", "quality"] = "first_seen"
    quality_field: str = "quality_score"
    # incremental index (tasks.dedup.index): documents sharing a band key with one indexed by an
    # earlier run are dropped as "minhash_index"; the kept ones are added and the index saved when
    # the stage completes. None: off. A path, absolute or relative to the working directory, or an
    # object-store URI (s3://bucket/prefix): read and saved through a local working copy, with
    # run_root's storage.options (tasks.dedup.index)
    index_dir: str | None = None
    # rows per band of the index's own banding of the same signature values (as many whole bands
    # as they fill): an index hit is not verified (earlier runs' texts are not at hand), so it keeps
    # 8 rows a band (p = 0.05 at Jaccard 0.5, where 28 x 4 gives 0.84): 14 x 8 of the 112 values,
    # the banding indexes were saved with before. None: the clustering's bands x rows
    index_rows: int | None = Field(default=8, gt=0)

    @model_validator(mode="after")
    def _index_within_signature(self):
        if self.index_rows is not None and self.index_rows > self.bands * self.rows:
            raise ValueError(f"index_rows {self.index_rows} exceeds the signature's bands x rows "
                             f"({self.bands} x {self.rows}) values")
        return self

    def index_banding(self) -> tuple[int, int]:
        """(bands, rows) of the index's keys."""
        if self.index_rows is None:
            return self.bands, self.rows
        return self.bands * self.rows // self.index_rows, self.index_rows


class UrlDedupConfig(Section):
    """URL dedup (tasks.dedup.urls, curate only): documents whose normalised URL is the same keep
    one copy: the newest `crawl_date`, else the longest text, else the first in corpus order."""

    enabled: bool = True
    # query parameters dropped before comparing URLs (case-insensitive; a trailing * is a prefix)
    tracking_params: list[str] = ["utm_*", "fbclid", "gclid", "dclid", "gbraid", "wbraid", "msclkid", "yclid",
                                  "twclid", "igshid", "mc_cid", "mc_eid", "_ga", "_gl", "_hsenc", "_hsmi",
                                  "mkt_tok", "vero_id", "oly_anon_id", "oly_enc_id"]


class LineDedupConfig(Section):
    """CCNet-style line dedup across the corpus (tasks.dedup.lines, curate only): a line whose
    normalised form occurs in more than `max_docs` distinct documents is removed from all of them."""

    enabled: bool = True
    max_docs: int = Field(default=10, ge=1)  # why 10: README, "Curation"
    # counting: "local" (one process), "ray" (hashes spilled to Parquet partitions, counted per
    # partition in Ray tasks) or "auto" (ray from ray_min_docs input documents)
    counting: Literal["auto", "local", "ray"] = "auto"
    ray_min_docs: int = Field(default=200_000, gt=0)
    partitions: int = Field(default=0, ge=0, le=65535)  # line-hash partitions (uint16 ids); 0: from the corpus size


class SubstringDedupConfig(Section):
    """Exact-substring dedup (Lee et al. 2022) over the curated shards, after MinHash
    (tasks.dedup.substring). Tokens are whitespace-separated words: curation runs before the
    tokenizer exists, and words are what the Gopher minimum counts."""

    enabled: bool = False
    min_tokens: int = Field(default=50, ge=2)  # shortest repeated span cut, in words
    # UTF-8 text bytes one task holds: the suffix array is built per group of consecutive documents
    # this big (repeats across groups are not found); a task peaks at ~14x this (32 MiB of web text: +437 MB)
    max_bytes_per_process: int = Field(default=64 << 20, gt=0)


class DedupConfig(Section):
    exact: bool = True
    minhash: MinHashConfig = MinHashConfig()
    url: UrlDedupConfig = UrlDedupConfig()
    lines: LineDedupConfig = LineDedupConfig()
    substring: SubstringDedupConfig = SubstringDedupConfig()


class PiiConfig(Section):
    """PII redaction (tasks.curate.pii), applied per document according to its source's
    `pii_policy`; documents whose source is not in the registry use `default_policy`."""

    enabled: bool = True
    kinds: list[Literal["email", "ip_address", "phone"]] = ["email", "ip_address", "phone"]
    default_policy: Literal["redact", "keep"] = "redact"


class DecontamBenchmark(Section):
    name: str = Field(pattern=r"^[a-z0-9_\-]+$")
    path: str  # relative to data_root unless absolute
    # how items are read: lambada = one JSONL line {"text"}; hellaswag = ctx + gold ending per line;
    # wikitext = one item per article (split at " = Title = " headings); jsonl_text = {"text"} per line
    format: Literal["lambada", "hellaswag", "wikitext", "jsonl_text"]


class DecontamConfig(Section):
    """Drop documents sharing a normalised word n-gram with an evaluation set (tasks.curate.decontam)."""

    enabled: bool = True
    n: int = Field(default=13, ge=3)
    benchmarks: list[DecontamBenchmark] = [
        DecontamBenchmark(name="lambada", path="eval/lambada_test.jsonl", format="lambada"),
        DecontamBenchmark(name="hellaswag", path="eval/hellaswag_val.jsonl", format="hellaswag"),
        DecontamBenchmark(name="wikitext", path="eval/wikitext-2/test.txt", format="wikitext"),
    ]
    on_missing: Literal["error", "skip"] = "error"  # a configured benchmark file that is absent


class QualityClassifierConfig(Section):
    """fastText reference-vs-crawl quality classifier (tasks.quality.classifier)."""

    enabled: bool = False
    # positives: reference corpus (globs relative to data_root: .txt, .jsonl[.gz], .parquet)
    positives: list[str] = ["text/gutenberg/*.txt", "text/linux-doc-rst.jsonl.gz"]
    # negatives: raw crawl text, e.g. ingest output shards or raw web docs
    negatives: list[str] = ["web/cc-main-2019-30-sample.jsonl.gz"]
    max_docs_per_class: int = Field(default=3000, gt=0)
    balance: bool = True  # use as many positives as negatives (the smaller class sets the size)
    passage_words: int = Field(default=200, gt=0)  # .txt files are cut into passages of this many words
    max_chars: int = Field(default=5000, gt=0)  # characters of a document used for training/scoring
    heldout_fraction: float = Field(default=0.2, gt=0, lt=1)
    seed: int = 0
    epoch: int = Field(default=5, gt=0)
    lr: float = Field(default=0.2, gt=0)  # halved and retried if fastText diverges (NaN)
    dim: int = Field(default=10, gt=0)  # with bucket=200k: an ~8 MB .bin
    word_ngrams: int = Field(default=2, gt=0)
    min_count: int = Field(default=2, gt=0)
    bucket: int = Field(default=200_000, gt=0)  # hashed n-gram buckets: keeps the model a few MB
    quantize: bool = False  # also write a quantised .ftz (product quantisation: slow, ~1 MB)
    quantize_cutoff: int = Field(default=20_000, gt=0)  # rows of the input/n-gram matrix kept
    threshold: float | None = Field(default=0.5, ge=0, le=1)  # keep docs scoring >= this
    keep_top_fraction: float | None = Field(default=None, gt=0, le=1)  # or keep the best fraction


class KenLMConfig(Section):
    """CCNet-style KenLM perplexity (tasks.quality.kenlm_lm)."""

    enabled: bool = False
    reference: list[str] = ["text/gutenberg/*.txt", "text/linux-doc-rst.jsonl.gz"]
    max_docs: int = Field(default=5000, gt=0)
    order: int = Field(default=5, ge=2)
    memory: str = "256M"  # lmplz -S
    prune: list[int] = []  # lmplz --prune, e.g. [0, 0, 1]
    bin_dir: str | None = None  # lmplz/build_binary; default: infra/.build/kenlm/bin (built by set-up)
    head_percentile: float = Field(default=30, gt=0, lt=100)  # per-source perplexity cut-offs
    tail_percentile: float = Field(default=60, gt=0, lt=100)
    drop_buckets: list[Literal["head", "middle", "tail"]] = []  # [] tags only; ["tail"] drops the tail

    @model_validator(mode="after")
    def _order(self) -> "KenLMConfig":
        if self.head_percentile >= self.tail_percentile:
            raise ValueError("head_percentile must be below tail_percentile")
        return self


class QualityTrainingData(Section):
    """Licence of files the quality models train on (recorded on them in lineage, like a source's)."""

    name: str = Field(pattern=r"^[a-z0-9_\-]+$")
    pattern: str  # glob, relative to data_root unless absolute
    licence: str
    provenance: str


class QualityConfig(Section):
    """Model-based quality (tasks/quality): an optional curate stage, off by default."""

    classifier: QualityClassifierConfig = QualityClassifierConfig()
    kenlm: KenLMConfig = KenLMConfig()
    batch_docs: int = Field(default=500, gt=0)  # documents per scoring batch
    # trained models are kept under <model_dir>/<kind>-<key>, key = sha256 of the training config and
    # the content of the training files; a later run with the same key reuses them (None: <run_root>/quality-models)
    model_dir: str | None = None
    reuse_models: bool = True
    # a training file matching none of these is recorded without a licence (and reported as unlicensed)
    training_data: list[QualityTrainingData] = [
        QualityTrainingData(name="gutenberg", pattern="text/gutenberg/*.txt", licence="public domain (Project Gutenberg)",
                            provenance="NLTK Gutenberg books via juletx/corpus-linguistics (shared/data/README.md)"),
        QualityTrainingData(name="linux_doc_rst", pattern="text/linux-doc-rst.jsonl.gz",
                            licence="GPL-2.0 (Linux kernel documentation)",
                            provenance="Debian linux-doc-6.1 RST sources as JSONL (shared/data/README.md)"),
        QualityTrainingData(name="cc_main_2019_30", pattern="web/cc-main-2019-30-sample.jsonl.gz",
                            licence="third-party web content from Common Crawl CC-MAIN-2019-30 (Common Crawl terms of use)",
                            provenance="allenai/dolma tests/data/formats/gz sample (shared/data/README.md)"),
    ]

    @property
    def enabled(self) -> bool:
        return self.classifier.enabled or self.kenlm.enabled


class AblateConfig(Section):
    """The curation ablation (tasks/ablate, `crucible ablate`): langid-only vs fully curated corpus."""

    eval_path: str = "eval/wikitext-2/valid.txt"  # clean held-out text, relative to data_root unless absolute
    detokenize: bool = True  # lm-eval's WikiText detokenizer: score natural text, not " @-@ " tokens
    eval_max_tokens: int | None = Field(default=None, gt=0)  # cap on held-out tokens (None: the whole file)
    eval_batch_size: int = Field(default=16, gt=0)  # windows per forward pass
    target_improvement: float = Field(default=0.05, ge=0)  # relative held-out loss reduction reported against


class CurateConfig(Section):
    langid: LangIdConfig = LangIdConfig()
    gopher_quality: GopherQualityConfig = GopherQualityConfig()
    gopher_repetition: GopherRepetitionConfig = GopherRepetitionConfig()
    c4: C4Config = C4Config()
    fineweb: FineWebConfig = FineWebConfig()
    decontam: DecontamConfig = DecontamConfig()
    pii: PiiConfig = PiiConfig()
    dedup: DedupConfig = DedupConfig()
    shard_docs: int = Field(default=2000, gt=0)  # documents per curated Parquet shard
    resume: bool = True  # reuse finished per-job parts (sha256-verified) and a complete output


class TokenizerProbesConfig(Section):
    """Real samples (relative to data_root) for the report's code / math / non-Latin-script rows."""

    enabled: bool = True
    rst: str = "text/linux-doc-rst.jsonl.gz"  # kernel docs: code-block and math bodies
    # Debian handbook pages per language; shard 00007 by default because configs/tiny.yaml trains on
    # shards 00000-00001 and every page sits in exactly one shard (shared/data/README.md).
    warc: str = "web/docs-crawl-00007.warc.gz"
    prose: str = "text/gutenberg/austen-persuasion.txt"  # English baseline row
    pages_per_language: int = Field(default=2, gt=0)
    max_chars: int = Field(default=20000, gt=0)  # per category


class TokenizerConfig(Section):
    vocab_size: int = Field(default=4096, ge=300)
    min_frequency: int = Field(default=2, ge=1)
    bos_token: str = "<|bos|>"
    eos_token: str = "<|endoftext|>"
    pad_token: str = "<|pad|>"
    batch_docs: int = Field(default=1000, gt=0)  # documents per batch fed to the BPE trainer
    normalizer: Literal["none", "nfc"] = "none"  # nfc is lossless on ingest's NFC text (round trip holds)
    split_digits: bool = False  # pre-tokenise every digit on its own (numbers never merge)
    # Held out of training (chosen by a hash of the document id, so independent of shard order):
    # the validation report's compression figures and the round trip on EVERY one of them.
    validation_fraction: float = Field(default=0.05, ge=0, lt=1)
    sample_fraction: float = Field(default=1.0, gt=0, le=1)  # of the other documents, the share trained on
    reference: bool = True  # also train HF's stock ByteLevelBPETokenizer on the same sample, for the report
    probes: TokenizerProbesConfig = TokenizerProbesConfig()


class TokensConfig(Section):
    val_fraction: float = Field(default=0.05, gt=0, lt=1)
    seed: int = 1234
    batch_docs: int = Field(default=512, gt=0)  # documents per encode_batch call
    ray: bool = True  # encode shards in parallel as Ray tasks (output identical either way)
    llmc: bool = False  # also write <split>.llmc.bin: the same ids behind llm.c's 1 KiB header
    # seed of the sources' mixture_weight resampling of the train split (tasks/tokens/mixture.py); apart
    # from `seed` so another draw of the mixture keeps the same validation documents
    mixture_seed: int = 1234


class MoEConfig(Section):
    """Mixture of experts in the MLP of every `every_n_layers`-th block (layer i is sparse when
    (i + 1) % every_n_layers == 0, Qwen's decoder_sparse_step); n_experts 0: a dense model."""
    n_experts: int = Field(default=0, ge=0)  # routed experts per MoE layer; 0: dense model
    top_k: int = Field(default=2, gt=0)  # routed experts per token
    n_shared_experts: int = Field(default=0, ge=0)  # experts every token goes through (DeepSeek)
    every_n_layers: int = Field(default=1, gt=0)
    expert_hidden: int | None = Field(default=None, gt=0)  # None: the dense MLP's hidden size
    score_func: Literal["softmax", "sigmoid"] = "softmax"  # router scores (Mixtral softmax, DeepSeek-V3 sigmoid)
    route_norm: bool = True  # renormalise the top-k weights to sum to 1
    # DeepSeek-V3 auxiliary-loss-free balancing: a per-expert bias added to the scores for selection
    # only, moved by this rate towards equal load after every step; 0: off
    bias_update_rate: float = Field(default=1e-3, ge=0)
    aux_loss: float = Field(default=0.0, ge=0)  # coefficient of the (Switch) load-balancing loss; 0: off
    router_z_loss: float = Field(default=0.0, ge=0)  # coefficient of logsumexp(router logits)^2 (ST-MoE); 0: off

    @model_validator(mode="after")
    def _top_k_fits(self) -> "MoEConfig":
        if self.n_experts and self.top_k > self.n_experts:
            raise ValueError(f"top_k ({self.top_k}) must not exceed n_experts ({self.n_experts})")
        return self


class ModelConfig(Section):
    n_layer: int = Field(default=4, gt=0)
    n_head: int = Field(default=4, gt=0)
    d_model: int = Field(default=128, gt=0)
    seq_len: int = Field(default=128, gt=0)
    mlp_ratio: float = Field(default=8 / 3, gt=0)
    rope_theta: float = 10000.0
    dropout: float = Field(default=0.0, ge=0, lt=1)
    # Off by default: the Hugging Face (Llama) export carries neither QK-norm nor a soft cap
    qk_norm: bool = False  # RMSNorm on each head's queries and keys before RoPE
    logit_softcap: float | None = Field(default=None, gt=0)  # logits -> cap * tanh(logits / cap)
    tie_embeddings: bool = True  # False: a separate output projection (lm_head)
    moe: MoEConfig = MoEConfig()

    @model_validator(mode="after")
    def _heads_divide(self) -> "ModelConfig":
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        if (self.d_model // self.n_head) % 2:
            raise ValueError("head dimension must be even for RoPE")
        return self


class ParallelConfig(Section):
    """The training layout: one DeviceMesh of (pp, dp_replicate, dp_shard, cp, tp); ep borrows its
    ranks from dp_shard x cp (torchtitan). The product of pp, dp_replicate, dp_shard, cp and tp is
    the world size; dp_shard -1 takes whatever the others leave. Checked against the model and the
    world size before any process starts (tasks/train/parallel_dims.py)."""
    dp_replicate: int = Field(default=1, gt=0)  # data-parallel replicas (HSDP's replicate dimension)
    dp_shard: int = Field(default=-1, ge=-1)  # FSDP2 sharding; -1: the rest of the world
    tp: int = Field(default=1, gt=0)  # tensor parallelism (+ sequence parallelism for norms and residuals)
    sequence_parallel: bool = True  # with tp > 1: norms and residuals sharded along the sequence
    pp: int = Field(default=1, gt=0)  # pipeline stages (torch.distributed.pipelining)
    pp_schedule: Literal["1f1b", "interleaved_1f1b", "gpipe"] = "1f1b"
    # micro-batches each pipeline step splits a data-parallel rank's batch into; None: the least
    # the schedule needs (pp, or 2 x pp stages for interleaved_1f1b)
    pp_microbatches: int | None = Field(default=None, gt=0)
    ep: int = Field(default=1, gt=0)  # expert parallelism (MoE): experts sharded over ep ranks of dp_shard x cp
    cp: int = Field(default=1, gt=0)  # context parallelism: refused where the backend cannot run it


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
    # steps between MLflow flushes; the console line and train_log.jsonl get every step
    log_every: int = Field(default=10, gt=0)
    seed: int = 1337
    threads_per_proc: int = Field(default=1, gt=0)
    rdzv_endpoint: str | None = None  # multi-node: "host:port"
    rdzv_id: str | None = None  # multi-node: job id shared by all nodes (default: the run name)
    grad_accum_steps: int = Field(default=1, gt=0)  # micro-batches per optimizer step
    resume: bool = False  # continue from the newest checkpoint in the output directory
    # Global batch in tokens (None: micro_batch_size x seq_len x world x grad_accum_steps). When set,
    # the gradient-accumulation steps follow from it and the world size, so the global sequence of
    # batches does not depend on the world size (and a run may resume on another world size).
    batch_tokens: int | None = Field(default=None, gt=0)
    lr_schedule: Literal["cosine", "wsd"] = "cosine"  # wsd: warmup-stable-decay
    wsd_decay_fraction: float = Field(default=0.2, gt=0, le=1)  # wsd: last fraction of max_steps decaying
    wsd_decay_shape: Literal["linear", "sqrt"] = "linear"  # sqrt: lr follows 1 - sqrt(progress)
    stop_at_step: int | None = Field(default=None, gt=0)  # end this launch after this step (checkpointed)
    max_restarts: int = Field(default=0, ge=0)  # torchrun --max-restarts: workers restart, resume from latest
    keep_last_checkpoints: int | None = Field(default=None, gt=0)  # None: keep all
    keep_best_checkpoints: int = Field(default=0, ge=0)  # also keep the N best (val loss, else train loss)
    # write checkpoints in a background thread (dcp.async_save) while training goes on; a checkpoint
    # becomes visible (renamed, in the manifest, event sent) only once completely written
    async_checkpoint: bool = False
    peak_flops_per_s: float | None = Field(default=None, gt=0)  # per process; MFU is logged when set
    spike_detection: bool = True
    spike_window: int = Field(default=20, ge=2)  # rolling window of healthy steps
    spike_min_history: int = Field(default=5, ge=2)  # healthy steps before detection starts
    spike_sigma: float = Field(default=6.0, gt=0)  # a spike: loss or grad norm > median + k * robust std
    spike_loss_ratio: float = Field(default=1.1, gt=1)  # ... and a loss spike also > this x the median loss
    spike_grad_ratio: float = Field(default=30.0, gt=1)  # ... and a grad-norm spike also > this x the median norm
    # consecutive spikes -> roll back to a checkpoint, or with none, re-baseline (adopt the new level)
    spike_rollback_after: int = Field(default=3, gt=0)
    spike_max_rollbacks: int = Field(default=3, ge=0)  # rollbacks per run; then persistent spikes re-baseline
    node_rank: int | None = Field(default=None, ge=0)  # multi-node: this node's rank (torchrun --node-rank)
    # attention never crosses a document boundary in a packed sequence; RoPE restarts per document
    doc_mask: bool = False
    z_loss: float = Field(default=0.0, ge=0)  # coefficient of logsumexp(logits)^2 (PaLM: 1e-4); 0: off
    # shorthand for a data-parallel-only layout: ddp (DistributedDataParallel) or fsdp2 (fully_shard
    # per block over all ranks); any train.parallel dimension set besides dp_shard uses the mesh
    parallelism: Literal["ddp", "fsdp2"] = "ddp"
    parallel: ParallelConfig = ParallelConfig()
    # recompute activations in the backward: none, selective (torchtitan's op policy: keep matmul
    # outputs except every second one, recompute the rest) or full (each block recomputed)
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    # batch-size ramp in tokens: the global batch starts at batch_ramp_start_tokens and grows linearly
    # to the full batch over the first batch_ramp_tokens tokens trained; the learning-rate warm-up
    # then follows the tokens of the ramp. None: no ramp
    batch_ramp_start_tokens: int | None = Field(default=None, gt=0)
    batch_ramp_tokens: int = Field(default=0, ge=0)
    dtype: Literal["fp32", "bf16"] = "fp32"  # bf16: autocast (fsdp2: bf16 params) with fp32 master weights
    compile: bool = False  # torch.compile each transformer block
    # continued pretraining: start from this checkpoint's model weights (a fresh run's step 0; the
    # learning-rate schedule starts over). init_sha256: its tree hash (tasks.core.hashing.sha256_tree),
    # checked before anything in it is read; init_optimizer: also load its AdamW moments
    init_from: str | None = None
    init_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    init_optimizer: bool = False

    @model_validator(mode="after")
    def _lr_order(self) -> "TrainConfig":
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr ({self.min_lr}) must not exceed lr ({self.lr})")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError("nnodes > 1 needs rdzv_endpoint (host:port of the rendezvous)")
        if self.stop_at_step is not None and self.stop_at_step > self.max_steps:
            raise ValueError(f"stop_at_step ({self.stop_at_step}) must not exceed max_steps ({self.max_steps})")
        if self.init_from and not self.init_sha256:
            raise ValueError("init_from needs init_sha256 (the checkpoint's tree hash): nothing is loaded unverified")
        return self


class WikiTextEvalConfig(Section):
    """WikiText-2 rolling perplexity (tasks.evaluate.suite)."""

    enabled: bool = True
    path: str = "eval/wikitext-2/test.txt"  # relative to data_root unless absolute
    limit: int | None = Field(default=2, gt=0)  # documents (of 62), evenly spread; None: all
    stride: int | None = Field(default=None, gt=0)  # targets per window; None: seq_len (lm-eval's windows)
    detokenize: bool = False  # apply lm-eval's wikitext detokenizer before scoring (words: original text)


class LambadaEvalConfig(Section):
    """LAMBADA (OpenAI version) last-word accuracy and target perplexity."""

    enabled: bool = True
    path: str = "eval/lambada_test.jsonl"
    limit: int | None = Field(default=200, gt=0)  # items (of 5153), evenly spread; None: all


class HellaSwagEvalConfig(Section):
    """HellaSwag validation accuracy / length-normalised accuracy."""

    enabled: bool = True
    path: str = "eval/hellaswag_val.jsonl"
    limit: int | None = Field(default=100, gt=0)  # items (of 10042, 4 endings each); None: all


class CalibrationEvalConfig(Section):
    """Expected calibration error of the multiple-choice task(s) (computed from their scores)."""

    enabled: bool = True
    bins: int = Field(default=10, gt=0)


class ReferenceEvalConfig(Section):
    """Score the same LAMBADA / HellaSwag subset with a reference model behind any OpenAI-compatible
    /v1/completions endpoint (tasks.evaluate.reference) and report it beside the checkpoint's."""

    enabled: bool = False
    base_url: str | None = None  # e.g. http://127.0.0.1:8600/v1 (the part before /completions)
    model: str | None = None  # the endpoint's model id
    api_key_env: str | None = None  # NAME of the env var holding the API key; the key is never logged
    tasks: list[Literal["lambada", "hellaswag"]] = ["lambada", "hellaswag"]
    # logprobs: echo + logprobs scoring, as lm-eval's completions models; generate: greedy
    # generation; auto: logprobs, falling back to generate if the endpoint refuses logprobs
    mode: Literal["auto", "logprobs", "generate"] = "auto"
    lambada_max_tokens: int = Field(default=8, gt=0)  # generation mode: tokens generated per item
    hellaswag_max_tokens: int = Field(default=24, gt=0)
    batch_size: int = Field(default=16, gt=0)  # prompts per request
    timeout: float = Field(default=120.0, gt=0)  # seconds per request
    max_retries: int = Field(default=2, ge=0)  # on connection errors, 429 and 5xx

    @model_validator(mode="after")
    def _endpoint(self) -> "ReferenceEvalConfig":
        if self.enabled and not (self.base_url and self.model):
            raise ValueError("evaluate.reference.enabled needs base_url and model")
        if self.api_key_env is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.api_key_env):
            raise ValueError("api_key_env is the NAME of an environment variable (e.g. OPENAI_API_KEY), not a key")
        return self


class EvaluateConfig(Section):
    max_val_batches: int = Field(default=20, gt=0)
    batch_size: int = Field(default=8, gt=0)
    prompts: list[str] = ["The Linux kernel", "Debian is", "In Python, a list"]
    sample_tokens: int = Field(default=32, gt=0)
    temperature: float = Field(default=0.8, ge=0)  # 0: greedy
    top_k: int | None = Field(default=50, gt=0)
    seed: int = 0  # sampling seed, so reports are reproducible
    # torch intra-op threads while evaluating (None: leave as is). 1 by default: a small model gains
    # little from more, and oversubscribed cores slowed evaluation ~10x when other stages ran.
    threads: int | None = Field(default=1, gt=0)
    # Task suite (tasks.evaluate.suite); each task on/off with its subset size.
    wikitext: WikiTextEvalConfig = WikiTextEvalConfig()
    lambada: LambadaEvalConfig = LambadaEvalConfig()
    hellaswag: HellaSwagEvalConfig = HellaSwagEvalConfig()
    calibration: CalibrationEvalConfig = CalibrationEvalConfig()
    reference: ReferenceEvalConfig = ReferenceEvalConfig()
    task_batch_size: int = Field(default=16, gt=0)  # sequences per forward pass in the task suite
    on_missing: Literal["error", "skip"] = "error"  # an enabled task whose data file is absent


class DeployConfig(Section):
    model_name: str = "crucible-tiny"
    max_val_loss: float = Field(default=8.0, gt=0)  # gate: absolute threshold
    # against a champion, the gate compares both on the fixed yardstick (tasks/deploy/yardstick.py),
    # in bits per byte: better on the challenger's own held-out data by at least min_improvement (δ),
    # worse on the champion's held-out data and WikiText by at most max_forgetting (ε); LAMBADA /
    # HellaSwag accuracy lower by at most max_forgetting_acc
    min_improvement: float = Field(default=0.0, ge=0)
    max_forgetting: float = Field(default=0.02, ge=0)
    max_forgetting_acc: float = Field(default=0.05, ge=0)
    yardstick_docs: int = Field(default=16, gt=0)  # held-out documents per part (old / new)
    yardstick_max_chars: int = Field(default=4000, gt=0)  # characters of each document scored
    host: str = "127.0.0.1"
    port: int = Field(default=8600, gt=0, lt=65536)
    serve: bool = True  # start/refresh the model server after registering a new champion
    threads: int = Field(default=2, gt=0)  # torch threads of the model server
    max_tokens_limit: int = Field(default=1024, gt=0)  # largest max_tokens a request may ask for
    max_n: int = Field(default=16, gt=0)  # largest n (completions per prompt) a request may ask for
    max_batch: int = Field(default=32, gt=0)  # sequences the server decodes together (continuous batching)
    # name of the environment variable holding the bearer token clients must send (None: the stack
    # generates the key into <state>/secrets/model-server.api-key; clients always need one)
    api_key_env: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    reload_in_place: bool = True  # a new champion is swapped into the running server (POST /v1/admin/reload)
    # a challenger is verified by a temporary server of its own on this port (0: any free port)
    verify_port: int = Field(default=0, ge=0, lt=65536)
    max_body_bytes: int = Field(default=1 << 20, gt=0)  # largest request body the server reads (413 above)
    max_streams: int = Field(default=64, gt=0)  # concurrent streamed completions (429 above)
    max_requests: int = Field(default=32, gt=0)  # concurrent non-streamed completions (429 above)
    request_timeout: float = Field(default=300.0, gt=0)  # seconds a non-streamed completion may take (503 after)


# Dense BF16 peaks and board power (TDP) from the vendors' datasheets (SXM/OAM modules); prices
# are rough on-demand USD per GPU-hour.
DEFAULT_GPUS: dict[str, dict[str, float]] = {
    "h100": {"peak_bf16_flops": 989e12, "memory_gb": 80, "price_per_hour": 3.00, "tdp_w": 700},  # SXM
    "h200": {"peak_bf16_flops": 989e12, "memory_gb": 141, "price_per_hour": 3.80, "tdp_w": 700},  # SXM
    "b200": {"peak_bf16_flops": 2250e12, "memory_gb": 180, "price_per_hour": 5.50, "tdp_w": 1000},
    "a100": {"peak_bf16_flops": 312e12, "memory_gb": 80, "price_per_hour": 1.80, "tdp_w": 400},  # SXM 80 GB
    "l40s": {"peak_bf16_flops": 362e12, "memory_gb": 48, "price_per_hour": 1.00, "tdp_w": 350},
    "mi300x": {"peak_bf16_flops": 1307e12, "memory_gb": 192, "price_per_hour": 2.50, "tdp_w": 750},
}


class GpuSpec(Section):
    """One accelerator in the planner's hardware table."""

    peak_bf16_flops: float = Field(gt=0)  # dense BF16 FLOP/s per GPU (datasheet, without 2:4 sparsity)
    memory_gb: float = Field(gt=0)  # device memory per GPU, 1 GB = 1e9 bytes
    price_per_hour: float = Field(ge=0)  # USD per GPU-hour: a ballpark on-demand figure, set your own
    # board power in watts: `crucible plan`'s energy estimate (the boards at TDP while training) and
    # the meter's power for a board that reports neither power.draw nor power.limit; None: unknown
    tdp_w: float | None = Field(default=None, gt=0)


class CuratePlanConfig(Section):
    """`crucible plan --curate`: the cluster a curation run is priced on (tasks/plan/curate.py)."""

    # 64 vCPUs, each counted as one of the benchmarks' per-core units (their figures are per CPU the OS shows)
    cores_per_node: int = Field(default=64, gt=0)
    # USD per node-hour: AWS EC2 m7i.16xlarge (64 vCPU, 256 GiB) on-demand, Linux, us-east-1, list price 2025
    node_price_per_hour: float = Field(default=3.2256, ge=0)
    # USD per GB-month: AWS S3 Standard, first 50 TB, us-east-1, list price 2025
    storage_price_per_gb_month: float = Field(default=0.023, ge=0)
    target_hours: float = Field(default=24, gt=0)  # picks the node count when none is given
    # where the measured rates are read from (relative to the repository unless absolute)
    rates_dir: str = "benchmarks/results"


class PlanConfig(Section):
    """The scaling-law planner (`crucible plan`, tasks/plan): hardware table and sizing rules."""

    # A config's `plan.gpus` extends this table; a known name may give only the fields it changes.
    gpus: dict[str, GpuSpec] = {name: GpuSpec(**spec) for name, spec in DEFAULT_GPUS.items()}
    mfu: float = Field(default=0.4, gt=0, le=1)  # model FLOPs utilisation when none is given
    tokens_per_param: float = Field(default=20.0, gt=0)  # Chinchilla compute-optimal ratio
    # model states per parameter as the trainer holds them (FSDP2): fp32 sharded weights, which are
    # the master copy (bf16 only in the gathered compute copy), fp32 sharded gradients, Adam m and v
    weight_bytes: float = Field(default=4, ge=0)  # fp32 weights
    grad_bytes: float = Field(default=4, ge=0)  # fp32 gradients (in memory, not in checkpoints)
    master_bytes: float = Field(default=0, ge=0)  # a separate master copy (4 for a trainer keeping bf16 weights)
    optimizer_bytes: float = Field(default=8, ge=0)  # Adam m and v, fp32
    compute_weight_bytes: float = Field(default=2, ge=0)  # bf16 copy of the layers FSDP has gathered
    aspect_ratio: float = Field(default=128, gt=0)  # d_model / n_layer when the shape is estimated
    gpus_per_node: int = Field(default=8, gt=0)  # tensor parallelism stays inside a node
    usable_memory_fraction: float = Field(default=0.9, gt=0, le=1)  # rest: CUDA context, fragmentation
    fsdp_shard_limit: int = Field(default=8, gt=0)  # most data-parallel ranks FSDP shards model states over
    microbatches_per_stage: int = Field(default=8, gt=0)  # 1F1B pipelines run this x pp microbatches
    target_days: float = Field(default=30, gt=0)  # picks the GPU count when none is given
    gpu: str = "h100"  # the accelerator the pipeline's plan stage prices the configured run on
    curate: CuratePlanConfig = CuratePlanConfig()  # `crucible plan --curate`

    @model_validator(mode="after")
    def _known_gpu(self) -> "PlanConfig":
        self.gpu = self.gpu.lower()
        if self.gpu not in self.gpus:
            raise ValueError(f"plan.gpu {self.gpu!r} is not in plan.gpus ({', '.join(sorted(self.gpus))})")
        return self

    @field_validator("gpus", mode="before")
    @classmethod
    def _extend_gpu_table(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value  # pydantic reports the type error
        table: dict[str, Any] = {name: dict(spec) for name, spec in DEFAULT_GPUS.items()}
        for name, spec in value.items():
            key = str(name).lower()
            if isinstance(spec, GpuSpec):
                spec = spec.model_dump()
            if isinstance(spec, dict) and key in table:
                table[key] = {**table[key], **spec}
            else:
                table[key] = spec
        return table


class EnergyConfig(Section):
    """Energy, CO2e and cost every stage records and `crucible plan` estimates (tasks/core/energy.py)."""

    enabled: bool = True  # off: stages record no energy (the run summary's totals are then absent)
    # gCO2e per kWh of the grid the run draws from; 475 is CodeCarbon's world average when the
    # location is unknown. Set your region's (e.g. ~60 France, ~370 USA, ~130 California)
    grid_gco2e_per_kwh: float = Field(default=475.0, ge=0)
    # CPU package TDP in watts and the hardware threads it covers; None: the measured RAPL counters
    # where readable, else 85 W (CodeCarbon's default for an unknown CPU) over the socket's threads
    cpu_tdp_w: float | None = Field(default=None, gt=0)
    cpu_tdp_threads: int | None = Field(default=None, gt=0)
    # watts of a board that reports no power.draw (x its utilization.gpu), in place of its
    # power.limit; a measured power.draw always wins. `crucible plan` also takes it in place of
    # plan.gpus[...].tdp_w. None: the board's power.limit, else the table's tdp_w
    gpu_tdp_w: float | None = Field(default=None, gt=0)
    # the price-table entry (plan.gpus) GPU-hours are priced at; None: plan.gpu. CPU-core-hours are
    # priced at plan.curate.node_price_per_hour / plan.curate.cores_per_node. Checked against
    # plan.gpus when the config loads
    gpu: str | None = None
    sample_interval_s: float = Field(default=0.5, gt=0)  # process-tree and GPU power sampling


class ContinueConfig(Section):
    """Scheduled continued pretraining (`continue:` in YAML): the data ledger, the replay mix, the
    learning-rate re-warm and the schedule. A cycle is gated like any challenger (deploy section)."""

    # SQLite record of every raw file consumed by a committed cycle (tasks.continued.ledger);
    # relative to stack.state_dir unless absolute
    ledger: str = "ledger.db"
    # the persistent MinHash index every cycle deduplicates against, used when
    # curate.dedup.minhash.index_dir is unset; relative to stack.state_dir unless absolute
    minhash_index: str = "minhash-index"
    # share of each cycle's training tokens replayed from earlier cycles' token shards (Ibrahim et
    # al. 2024: 0.05 for a weak distribution shift, 0.25 for a strong one)
    replay_fraction: float = Field(default=0.25, ge=0, lt=1)
    replay_seed: int = 0
    # rewarm_cosine: from the champion, a linear re-warm over rewarm_steps from 0 to `lr` (train.lr
    # unless set), then cosine re-decay to train.min_lr over the cycle's steps (Ibrahim et al. 2024).
    # wsd: the champion was trained warmup-stable-decay; the cycle starts from its run's last kept
    # checkpoint before the decay began (verified against its checkpoint manifest) with a new stable
    # phase at `lr` and a decay over the last train.wsd_decay_fraction of the cycle's steps
    # (rewarm_steps of warmup, none unless set). auto: wsd when the champion is WSD and such a
    # checkpoint is kept, else rewarm_cosine; an explicit wsd that cannot be done is refused.
    lr_schedule: Literal["auto", "rewarm_cosine", "wsd"] = "auto"
    rewarm_steps: int | None = Field(default=None, ge=0)  # None: train.warmup_steps (wsd: 0)
    lr: float | None = Field(default=None, gt=0)
    max_steps: int | None = Field(default=None, gt=0)  # optimizer steps per cycle (None: train.max_steps)
    init_optimizer: bool = False  # also continue the champion's AdamW moments
    # a continuation keeps the champion's tokenizer; true asks to retrain it and is refused
    retrain_tokenizer: bool = False
    # cron schedule of the continue-pretraining deployment `crucible up` serves (None: run on demand)
    schedule: str | None = None
    timezone: str = "UTC"

    @field_validator("schedule")
    @classmethod
    def _cron(cls, v: str | None) -> str | None:
        if v is not None:
            from datetime import datetime

            from cronsim import CronSim, CronSimError  # Prefect's own cron parser

            try:
                CronSim(v, datetime(2026, 1, 1))
            except CronSimError:
                raise ValueError(f"{v!r} is not a cron expression (e.g. \"0 3 * * *\": every day at 03:00)") from None
        return v

    @field_validator("timezone")
    @classmethod
    def _timezone(cls, v: str) -> str:
        from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

        try:
            ZoneInfo(v)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"{v!r} is not an IANA time zone (e.g. UTC, Europe/Berlin)") from None
        return v


class StorageConfig(Section):
    """The object store behind a remote run_root (s3://bucket/prefix, any fsspec URL): the store is
    the run's record; the driver keeps a working copy under cache_dir (never under runs/), and Ray
    workers stage their inputs in from the store and their outputs out to it (tasks/core/storage.py)."""
    # the fsspec file system's options (s3fs: endpoint_url, client_kwargs, key/secret/token as
    # "${ENV_VAR}" references only, resolved where the file system is made and never stored)
    options: dict[str, Any] = {}
    cache_dir: str | None = None  # None: $XDG_CACHE_HOME (or ~/.cache)/crucible/store
    check_timeout: float = Field(default=20.0, gt=0)  # the bucket check before anything is written
    # each Ray node's cache of training's token files (staged job inputs are per job, not cached): beyond
    # this size the least recently used go (those used in the last cache_min_age_s stay: a rank may be
    # about to open them)
    node_cache_gb: float = Field(default=50.0, gt=0)
    cache_min_age_s: float = Field(default=3600.0, ge=0)

    @field_validator("options")
    @classmethod
    def _no_literal_secrets(cls, v: dict[str, Any]) -> dict[str, Any]:
        bad = literal_secret_options(v)
        if bad:
            raise ValueError(f"credentials in storage.options must be \"${{ENV_VAR}}\" references, not literals: {bad}")
        return v


class PipelineConfig(Section):
    name: str = Field(pattern=r"^[A-Za-z0-9_\-]+$")
    data_root: str = str(DEFAULT_DATA_ROOT)
    run_root: str = "runs"  # run directories go under here: a local path or an object-store URI (storage)
    storage: StorageConfig = StorageConfig()
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
    plan: PlanConfig = PlanConfig()
    energy: EnergyConfig = EnergyConfig()
    quality: QualityConfig = QualityConfig()
    ablate: AblateConfig = AblateConfig()
    # `continue` is a Python keyword: the YAML key is the alias; dumps without by_alias ("continue_")
    # validate too, so configs round-trip through model_dump/model_validate as every other section
    continue_: ContinueConfig = Field(default_factory=ContinueConfig, alias="continue",
                                      validation_alias=AliasChoices("continue", "continue_"))

    @model_validator(mode="before")
    @classmethod
    def _without_infra_sections(cls, data: Any) -> Any:
        # a subclass that has them as fields (infra.settings.CrucibleConfig) keeps and validates them
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if k in cls.model_fields or k not in INFRA_SECTIONS}
        return data

    @model_validator(mode="after")
    def _energy_gpu_priced(self) -> "PipelineConfig":
        # energy.gpu names the price-table entry every stage's GPU-hours are costed at: a typo fails here
        if self.energy.gpu is not None:
            key = self.energy.gpu.lower()
            if key not in self.plan.gpus:
                raise ValueError(f"energy.gpu {self.energy.gpu!r} is not in plan.gpus "
                                 f"({', '.join(sorted(self.plan.gpus))})")
            self.energy.gpu = key
        return self

    @model_validator(mode="after")
    def _layout_fits(self) -> "PipelineConfig":
        # the training layout against the model and the world size, before any process starts
        from tasks.train.parallel_dims import ParallelDims

        ParallelDims.from_config(self)
        return self

    @field_validator("sources")
    @classmethod
    def _unique_sources(cls, sources: list[SourceConfig]) -> list[SourceConfig]:
        names = [s.name for s in sources]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate source names: {dupes}")
        return sources

    def resolve_uri(self, uri: str) -> str:
        """A source URI relative to data_root becomes absolute; URLs and absolute paths stay; one
        starting with ./ is relative to the working directory (e.g. a landing folder of new files)."""
        if re.match(r"^[a-z][a-z0-9+.\-]*://", uri) or os.path.isabs(uri):
            return uri
        if uri.startswith("./"):
            return str(Path.cwd() / uri[2:])
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
        got = f"got {e.get('input')!r}"
        if "storage_options" in path or (isinstance(e.get("input"), dict) and "storage_options" in e["input"]):
            got = "input not shown: storage_options may hold credentials"
        if path.endswith("postgres_url"):
            got = "input not shown: it may hold a password"
        if path == "<root>":  # a check across sections (e.g. the training layout): its message names the fields
            lines.append(f"  {e['msg'].removeprefix('Value error, ')}"[:400])
            continue
        lines.append(f"  {path}: {e['msg']} ({got})"[:300])
    return "invalid config:\n" + "\n".join(lines)


def load_config(path: str | Path, overrides: list[str] | None = None,
                model: type[PipelineConfig] = PipelineConfig) -> PipelineConfig:
    """The YAML file at `path` with `overrides` applied, validated as `model` (the stage layer's
    sections; infra.settings.load_config: the whole file, the stack's sections too)."""
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
        return model.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_format_errors(e)) from None
