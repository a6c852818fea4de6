"""The stage registry: every stage and the pretrain subflow it runs in.

The flows' generic stage task (flows/stage_task.py) takes each task's name, lineage job name,
documentation and config sections from here, and so do the lineage service's sample events;
tests/test_stages.py checks flows/pretrain.py against PRETRAIN_FLOWS. A new stage is one file (a
`tasks.core.stage.Stage`) plus one line in ALL_STAGES below (and, for a new subflow, one FlowSpec)."""
from __future__ import annotations

from dataclasses import dataclass

from tasks.ablate.stage import AblateStage
from tasks.continued.stage import ReplayMixStage, YardstickStage
from tasks.core.stage import Stage
from tasks.curate.stage import CurateStage
from tasks.deploy.stage import DeployStage
from tasks.evaluate.stage import EvaluateStage
from tasks.ingest.stage import IngestStage
from tasks.plan.stage import PlanStage
from tasks.quality.stage import QualityStage
from tasks.tokenizer.stage import TokenizerStage
from tasks.tokens.stage import TokensStage
from tasks.train.stage import TrainStage

# In pipeline order. The ablate stage runs in its own flow (flows/ablate.py); the replay mix only in
# continued-pretraining cycles (flows/continued.py).
ALL_STAGES: tuple[Stage, ...] = (
    IngestStage(), CurateStage(), QualityStage(), TokenizerStage(), TokensStage(), ReplayMixStage(), PlanStage(),
    TrainStage(), EvaluateStage(), YardstickStage(), DeployStage(), AblateStage())
STAGES: dict[str, Stage] = {s.name: s for s in ALL_STAGES}
CONTINUE_ONLY = {"mix", "yardstick"}


@dataclass(frozen=True)
class FlowSpec:
    name: str
    doc: str

    @property
    def stages(self) -> tuple[Stage, ...]:
        """The stages the pretrain flow runs in this subflow."""
        return tuple(s for s in STAGES.values() if s.flow == self.name and s.name not in CONTINUE_ONLY)


# The pretrain flow's subflows, in DAG order (flows/pretrain.py).
PRETRAIN_FLOWS: list[FlowSpec] = [
    FlowSpec("curate", "Subflow: ingest the registered sources, filter and deduplicate the documents, then keep "
                       "those the quality models accept."),
    FlowSpec("train_tokenizer", "Subflow: train the byte-level BPE tokenizer on the curated corpus."),
    FlowSpec("prepare_tokens", "Subflow: encode the curated corpus with the tokenizer and pack it into token shards."),
    FlowSpec("train", "Subflow: price the run with the planner, then train the model with torchrun, writing "
                      "distributed checkpoints."),
    FlowSpec("evaluate", "Subflow: evaluate every checkpoint (validation loss, perplexity, task suite); with the "
                         "stack's triggered flows on, collect the event-triggered evaluate-checkpoint runs' reports."),
    FlowSpec("deploy", "Subflow: gate the best checkpoint, register it in MLflow and serve it; with the stack's "
                       "triggered flows on, collect what the event-triggered deploy-model runs did."),
]
# The continue-pretraining flow's own subflows (flows/continued.py); it reuses the others above.
CONTINUE_FLOWS: list[FlowSpec] = [
    FlowSpec("replay_mix", "Subflow: mix the cycle's new token shards with documents replayed from earlier cycles."),
    FlowSpec("gate_and_deploy", "Subflow: score the champion and the best checkpoint on the fixed yardstick (bits "
                                "per byte), then gate, register and serve the challenger if it is better and has "
                                "not forgotten."),
]
ROOT_FLOWS = {
    "pretrain": "The pretrain flow (flows/pretrain.py): raw web pages -> curated corpus -> tokenizer -> token "
                "shards -> torchrun training -> evaluation of every checkpoint -> gated deployment.",
    "continue-pretraining": "The continue-pretraining flow (flows/continued.py): one cycle of continued pretraining: "
                            "the raw files the data ledger has not seen, curated against everything kept before, "
                            "encoded with the champion's tokenizer, mixed with replayed earlier tokens, trained "
                            "from the champion's weights, evaluated and gated.",
    "curation": "The curation flow (flows/curation.py, `crucible curate`): the pretrain flow's curate subflow "
                "alone: raw web pages -> ingested, filtered and deduplicated, quality-scored corpus.",
    "ablate": "The ablate flow (flows/ablate.py): the same model and token budget trained on the langid-only and "
              "the fully curated corpus, both scored on clean held-out text.",
}
FLOW_DOCS = {f.name: f.doc for f in PRETRAIN_FLOWS + CONTINUE_FLOWS} | ROOT_FLOWS


def stage(name: str) -> Stage:
    try:
        return STAGES[name]
    except KeyError:
        raise KeyError(f"no stage {name!r}; registered: {', '.join(STAGES)}") from None
