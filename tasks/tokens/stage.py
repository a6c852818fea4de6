"""The tokens stage: encode the curated corpus and pack it into train/validation token shards."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

from tasks.config import PipelineConfig
from tasks.core.fs import location
from tasks.core.sections import Reads
from tasks.core.stage import Markdown, Stage, TokensResult
from tasks.lineage import dataset_for_path
from tasks.lineage.facets import CrucibleMixtureDatasetFacet
from tasks.lineage.outputs import DATASET_DOCS

TOKENS_CARD = "DATASET_CARD.md"


def mixture_record(data: dict) -> dict:
    """The stage's record of the mixture weighting: documents in (train + val, before weighting) and
    out (written at least once) with those the weighting dropped, and per source its weight, target
    and effective token share and tokens, as top-level numbers (the stage's MLflow metrics)."""
    mixture = data["mixture"]
    docs_in = sum(v["natural_docs"] for v in mixture["by_source"].values()) + data["splits"]["val"]["docs"]
    record = {"docs_in": docs_in, "docs_out": docs_in - sum(mixture["dropped"].values()),
              "dropped": dict(mixture["dropped"])}
    for source, v in mixture["by_source"].items():
        record.update({f"mixture.share.{source}": v["share"], f"mixture.target_share.{source}": v["target_share"],
                       f"mixture.tokens.{source}": v["tokens"], f"mixture.dropped_docs.{source}": v["dropped_docs"],
                       f"mixture.repeats.{source}": v["repeats"]})
    return record


class TokensStage(Stage):
    name, task, flow = "tokens", "encode_and_pack", "prepare_tokens"
    doc = ("Encode the curated shards with the tokenizer and pack the token ids into train/validation shards, the "
           "train split weighted by the sources' mixture weights.")
    result_type = TokensResult

    def run(self, cfg: Annotated[PipelineConfig, Reads("sources", "tokens", "tokenizer", "curate", "ray")],
            inputs, ctx) -> TokensResult:
        from tasks.core.io import atomic_write_text
        from tasks.curate.card import render_token_card
        from tasks.tokens import prepare_tokens
        from tasks.tracking.mlflow_tracking import metric_name

        out = ctx.stage_dir(self.name)
        # the tokenizer as named: a store champion's URI stays a URI (a Path would make 's3://' 's3:/')
        # a continued cycle's: held to the champion's signed tokenizer_sha256 on the bytes encoded with
        data = prepare_tokens(cfg, location(inputs.tokenizer), [Path(p) for p in inputs.shards], out,
                              expected_sha256=inputs.tokenizer_sha256)
        data.update(mixture_record(data))
        card = render_token_card(cfg, data)
        data["dataset_card"] = str(atomic_write_text(out / TOKENS_CARD, card))
        mixture = data["mixture"]
        if ctx.mlflow_run_id:  # the weights as the stage's params (its metrics are the record's numbers)
            from tasks.tracking import Tracker

            params = {metric_name(f"mixture.weight.{s}"): v["weight"] for s, v in mixture["by_source"].items()}
            Tracker(ctx.tracking_uri, ctx.experiment).log_params(
                ctx.mlflow_run_id, {**params, "mixture.seed": mixture["seed"], "mixture.applied": mixture["applied"]})
        facets = {"crucible_mixture": CrucibleMixtureDatasetFacet(
            split=mixture["split"], seed=mixture["seed"], applied=mixture["applied"], by_source=mixture["by_source"],
            dropped=mixture["dropped"])}
        splits = data["splits"]
        outputs = [dataset_for_path(data["index_path"], output=True, doc=DATASET_DOCS["tokens_index"], facets=facets)]
        outputs += [dataset_for_path(s["path"], output=True, doc=DATASET_DOCS["tokens_split"].format(split=name),
                                     rows=s.get("tokens"), facets=facets if name == "train" else None)
                    for name, s in splits.items()]
        # document start offsets: training reads them for document-aware attention masks
        outputs += [dataset_for_path(s["doc_starts"], output=True) for s in splits.values()]
        # each document's data source (per-source token counts; a continued cycle's mix reports them)
        outputs += [dataset_for_path(s["doc_sources"], output=True) for s in splits.values()]
        return TokensResult(data, outputs=outputs,
                            reports=[Markdown("token-mixture", card, "Target and effective token share per source")])
