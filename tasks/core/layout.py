"""RunLayout: the one place that knows where a pipeline run keeps its files.

    <run_root>/<run_name>/
        config.json  summary.json  lineage.jsonl  energy.jsonl
        ingest/  curate/  quality/  tokenizer/tokenizer.json  tokens/index.json  plan/plan.json
        train/checkpoints/step-NNNNNN/
        evaluate/<checkpoint>.json          evaluate/triggered/<checkpoint>.json
        deploy/triggered/<checkpoint>.json  ablate/

Everything else (flows, the triggered flows, deployment, the lineage sample) asks a RunLayout
instead of joining path pieces by hand. A remote run_root (s3://...) is worked on in its local
working copy (tasks.core.storage); its files reach the store when the flows push them. Its
checkpoints, which training writes to the store only, are named by their URIs (of_checkpoint maps
one to its run's layout) and read there."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tasks.core.storage import PathEscape, StorageError, is_remote, local_place, local_root_of

TOKENIZER_FILE = "tokenizer.json"
TOKENS_INDEX_FILE = "index.json"
CHECKPOINTS_DIR = "checkpoints"


@dataclass(frozen=True)
class RunLayout:
    run_dir: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "run_dir", Path(self.run_dir).resolve())

    @classmethod
    def for_run(cls, run_root: str | Path, run_name: str) -> "RunLayout":
        return cls(local_root_of(run_root) / run_name)

    @classmethod
    def of_checkpoint(cls, checkpoint: str | Path) -> "RunLayout":
        """The run a checkpoint belongs to; refuses a path outside run_dir/train/checkpoints/. A
        checkpoint named by its object on a store belongs to the run in that store's working copy."""
        try:
            ckpt = local_place(checkpoint) if is_remote(checkpoint) else Path(checkpoint).resolve()
        except (StorageError, PathEscape) as e:
            raise ValueError(str(e)) from None
        if ckpt.parent.name != CHECKPOINTS_DIR or ckpt.parent.parent.name != "train":
            raise ValueError(f"{ckpt} is not a pipeline checkpoint (run_dir/train/checkpoints/step-N)")
        return cls(ckpt.parents[2])

    @classmethod
    def is_run_checkpoint(cls, checkpoint: str | Path) -> bool:
        try:
            cls.of_checkpoint(checkpoint)
        except ValueError:
            return False
        return True

    def owns(self, checkpoint: str | Path) -> bool:
        """Whether `checkpoint` is one of this run's (a signed record copied from another run names
        that run's checkpoint: its signature verifies anywhere)."""
        try:
            return RunLayout.of_checkpoint(checkpoint).run_dir == self.run_dir
        except ValueError:
            return False

    @property
    def run_name(self) -> str:
        return self.run_dir.name

    def stage_dir(self, stage: str, create: bool = True) -> Path:
        path = self.run_dir / stage
        if create:
            path.mkdir(parents=True, exist_ok=True)
        return path

    @property
    def config_file(self) -> Path:
        return self.run_dir / "config.json"

    @property
    def summary_file(self) -> Path:
        return self.run_dir / "summary.json"

    @property
    def lineage_log(self) -> Path:
        return self.run_dir / "lineage.jsonl"

    @property
    def energy_log(self) -> Path:
        """One line per finished stage run: its energy record (tasks/core/energy.py)."""
        return self.run_dir / "energy.jsonl"

    @property
    def tokenizer_file(self) -> Path:
        return self.run_dir / "tokenizer" / TOKENIZER_FILE

    @property
    def tokens_index(self) -> Path:
        return self.run_dir / "tokens" / TOKENS_INDEX_FILE

    @property
    def plan_file(self) -> Path:
        return self.run_dir / "plan" / "plan.json"

    @property
    def checkpoints_dir(self) -> Path:
        return self.run_dir / "train" / CHECKPOINTS_DIR

    def eval_report(self, checkpoint: str | Path) -> Path:
        """Where the pretrain flow's own evaluation of a checkpoint goes."""
        return self.run_dir / "evaluate" / f"{Path(checkpoint).name}.json"

    @property
    def triggered_eval_dir(self) -> Path:
        return self.run_dir / "evaluate" / "triggered"

    def triggered_eval_report(self, checkpoint: str | Path) -> Path:
        """The evaluate-checkpoint flow's report of a checkpoint (with the gate's verdict)."""
        return self.triggered_eval_dir / f"{Path(checkpoint).name}.json"

    def triggered_deploy_record(self, checkpoint: str | Path) -> Path:
        """The deploy-model flow's result for a checkpoint."""
        return self.run_dir / "deploy" / "triggered" / f"{Path(checkpoint).name}.json"
