"""One shape for every stage: a `Stage` reads its inputs, does its work and returns a typed result.

    class MyStage(Stage):
        name = "my_stage"              # stage directory, MLflow run name, summary key
        task = "do_my_stage"           # Prefect task and OpenLineage job name
        flow = "train"                 # the pretrain subflow it runs in
        doc = "What it does."          # OpenLineage job documentation
        result_type = MyResult

        # the config sections it reads, and the only ones it can (tasks/core/sections.py)
        def run(self, cfg: Annotated[PipelineConfig, Reads("model", "train")], inputs, ctx) -> MyResult: ...

A stage is plain Python: tests call `stage.run(...)` directly. The stage wrapper hands it the tree
with every section its signature does not name withheld (`stage_config`), and the lineage
`crucible_config` facet records exactly those sections. flows/stage_task.py turns each
registered stage (tasks/registry.py) into a Prefect task that adds the MLflow run, the OpenLineage
START/COMPLETE events and the Prefect artifacts around `run`; nothing here imports Prefect.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar

from tasks.config import PipelineConfig
from tasks.core.constants import LINEAGE_NAMESPACE
from tasks.core.layout import RunLayout
from tasks.lineage import dataset_for_path


@dataclass
class Markdown:
    """A markdown report for people watching the run (a Prefect markdown artifact)."""
    key: str
    markdown: str
    description: str


@dataclass
class Table:
    """A table for people watching the run (a Prefect table artifact)."""
    key: str
    rows: list[dict]
    description: str


@dataclass
class StageInputs:
    """What a stage consumes from the stages before it (each stage reads the fields it needs)."""
    shards: list[str] = field(default_factory=list)  # document shards (Parquet)
    tokenizer: str | None = None  # tokenizer.json
    tokenizer_sha256: str | None = None  # the sha256 its bytes must have (a continued cycle: the champion's, signed)
    tokens_index: str | None = None  # token shards' index.json
    checkpoint: str | None = None  # one checkpoint directory
    evaluation: dict | None = None  # an evaluation report (the deploy stage's input)
    train_run_id: str | None = None  # the training stage's MLflow run
    # continued pretraining: earlier cycles' token indexes (the mix: {index: the sha256 a signed chain vouches for})
    replay: list[str] | dict[str, str] = field(default_factory=list)
    # evaluate / deploy with the stack's triggered flows on: what their completed flow run recorded,
    # collected by the flow (flows/triggered_runs.py); the stage reports it (None: it does the work)
    triggered: dict | None = None


@dataclass
class StageContext:
    """The run a stage belongs to: its paths, its MLflow run, and how to report progress."""
    layout: RunLayout
    run_name: str
    tracking_uri: str
    experiment: str
    mlflow_run_id: str | None = None  # this stage's own (nested) MLflow run
    # the stack's event-triggered flows evaluate and deploy checkpoints as they are saved: the
    # evaluate/deploy stages then report their results (StageInputs.triggered) instead of doing the work twice
    triggered: bool = False
    progress: Callable[[str], Callable | None] = lambda unit: None  # unit -> progress(done, total, note)
    # (cfg, checkpoint_dir, tokenizer_path, model_name, version, tracking_uri) -> server info: how the
    # deploy stage serves a model, and verifies a challenger in a server of its own (the stack's
    # model-server supervisor), None: not served here
    serve_model: Callable[..., dict] | None = None
    verify_model: Callable[..., str] | None = None
    model_server_status: Callable[[], dict | None] | None = None  # the running server's {url, pid, healthy}
    lineage: Any = None  # the stage run's lineage handle (training parents its torchrun run to it)
    lineage_namespace: str = LINEAGE_NAMESPACE  # of the run's jobs (the stack's lineage.namespace)
    worker_module: str | None = None  # training: the torchrun entry module (None: the plain worker)

    def stage_dir(self, stage: str) -> Path:
        return self.layout.stage_dir(stage)


@dataclass
class StageResult:
    """A stage's result: `data` is its JSON record (the run summary's entry, the MLflow `<stage>.json`);
    the rest is what the wrapper needs around it."""
    data: dict
    inputs: list = field(default_factory=list)  # lineage input datasets known only after the run
    outputs: list = field(default_factory=list)  # lineage output datasets
    primary: str | None = None  # the output node the Prefect run links to (default: the first output)
    reports: list[Markdown | Table] = field(default_factory=list)


class DocumentsResult(StageResult):
    """ingest, curate, quality: Parquet document shards plus per-step accounting."""

    @property
    def shards(self) -> list[str]:
        return self.data["shards"]


class TokenizerResult(StageResult):
    @property
    def path(self) -> str:
        return self.data["path"]


class TokensResult(StageResult):
    @property
    def index_path(self) -> str:
        return self.data["index_path"]


class PlanResult(StageResult):
    @property
    def path(self) -> str:
        return self.data["path"]


class TrainResult(StageResult):
    @property
    def checkpoints(self) -> list[str]:
        return self.data["checkpoints"]

    @property
    def mlflow_run_id(self) -> str | None:
        return self.data.get("mlflow_run_id")


class EvalResult(StageResult):
    @property
    def checkpoint(self) -> str:
        return self.data["checkpoint"]

    @property
    def val_loss(self) -> float:
        return self.data["val_loss"]


class DeployResult(StageResult):
    @property
    def version(self) -> int | str | None:
        return self.data.get("version")


class Stage:
    """Base of every stage; see the module docstring."""

    name: ClassVar[str]
    task: ClassVar[str]
    flow: ClassVar[str]
    doc: ClassVar[str]
    result_type: ClassVar[type[StageResult]] = StageResult
    # (task, doc) of the stage when the stack's event-triggered flows do its work and it only collects
    # their results (StageContext.triggered): a job of its own in the lineage, with no START inputs
    collect: ClassVar[tuple[str, str] | None] = None

    def input_datasets(self, cfg: PipelineConfig, inputs: StageInputs) -> list:
        """Lineage inputs known before the run (START event): the files it is handed."""
        paths = [p for p in (inputs.checkpoint, inputs.tokenizer, inputs.tokens_index) if p]
        return [dataset_for_path(p) for p in paths + list(inputs.shards)]

    def run(self, cfg: PipelineConfig, inputs: StageInputs, ctx: StageContext) -> StageResult:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<stage {self.name}>"
