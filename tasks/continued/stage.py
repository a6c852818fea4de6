"""The stages only a continued-pretraining cycle runs: the replay mix (the cycle's new tokens plus
replayed documents of earlier cycles, tasks/continued/mix.py) and the fixed yardstick both the
champion and the challenger are scored on (tasks/deploy/yardstick.py), as a stage of its own."""
from __future__ import annotations

from typing import Annotated

from tasks.config import PipelineConfig
from tasks.core.sections import Reads
from tasks.core.stage import Markdown, Stage, StageInputs, StageResult, Table, TokensResult
from tasks.lineage import dataset_for_path
from tasks.lineage.facets import CrucibleTokenMixDatasetFacet
from tasks.lineage.outputs import DATASET_DOCS


class ReplayMixStage(Stage):
    name, task, flow = "mix", "mix_replay", "replay_mix"
    doc = ("Build a continued-pretraining cycle's training mix: the new token shards plus whole documents replayed "
           "from earlier cycles' token shards, continue.replay_fraction of the tokens.")
    result_type = TokensResult

    def input_datasets(self, cfg, inputs: StageInputs) -> list:
        return [dataset_for_path(p) for p in [inputs.tokens_index, *inputs.replay]]

    def run(self, cfg: Annotated[PipelineConfig, Reads("continue_")], inputs, ctx) -> TokensResult:
        from tasks.continued.mix import build_mix

        c = cfg.continue_
        # the pool as the flow hands it ({index: the sha256 the champion's signed chain vouches for}): held to it
        data = build_mix(inputs.tokens_index, inputs.replay, c.replay_fraction, c.replay_seed, ctx.stage_dir(self.name))
        mix = data["mix"]
        # top-level numbers become the stage's MLflow metrics (per source: tokens.<source>, ...);
        # tokens by origin and by source are in data["mix"]
        data.update(new_tokens=mix["new_tokens"], replay_tokens=mix["replay_tokens"], replay_share=mix["replay_share"])
        for source, v in mix["by_source"].items():
            data.update({f"tokens.{source}": v["tokens"], f"new_tokens.{source}": v["new_tokens"],
                         f"replay_tokens.{source}": v["replay_tokens"], f"share.{source}": v["share"]})
        rows = "\n".join(f"| {v['role']} | `{origin}` | {v['docs']:,} | {v['tokens']:,} |"
                         for origin, v in mix["by_origin"].items())
        sources = "\n".join(f"| {name} | {v['new_tokens']:,} | {v['replay_tokens']:,} | {v['share']:.3f} |"
                            for name, v in mix["by_source"].items())
        report = (f"**{mix['new_tokens']:,} new + {mix['replay_tokens']:,} replayed tokens** (replay share "
                  f"{mix['replay_share']:.3f}, configured {mix['replay_fraction']:.3f})\n\n"
                  f"| role | token index | docs | tokens |\n|---|---|---|---|\n{rows}\n\n"
                  f"| source | new tokens | replayed tokens | share of the mix |\n|---|---|---|---|\n{sources}\n")
        mix_facet = CrucibleTokenMixDatasetFacet(
            replay_fraction=mix["replay_fraction"], replay_share=mix["replay_share"], new_tokens=mix["new_tokens"],
            replay_tokens=mix["replay_tokens"], by_source=mix["by_source"])
        outputs = [dataset_for_path(data["index_path"], output=True, doc=DATASET_DOCS["tokens_mix"],
                                    facets={"crucible_token_mix": mix_facet}),
                   dataset_for_path(data["splits"]["train"]["path"], output=True,
                                    doc=DATASET_DOCS["tokens_split"].format(split="train (mix)"),
                                    rows=data["splits"]["train"]["tokens"])]
        return TokensResult(data, outputs=outputs,
                            reports=[Markdown("training-mix", report, "New and replayed tokens of this cycle")])


class YardstickStage(Stage):
    name, task, flow = "yardstick", "score_yardstick", "gate_and_deploy"
    doc = ("Score the champion and the best checkpoint of a continued-pretraining cycle on one pinned evaluation set "
           "(earlier cycles' held-out text, this cycle's, WikiText-2) in bits per byte, and decide the gate: better "
           "on the new data, no forgetting of the old.")

    def input_datasets(self, cfg, inputs: StageInputs) -> list:
        return [dataset_for_path(p) for p in [inputs.evaluation["checkpoint"], inputs.tokenizer, inputs.tokens_index,
                                              *inputs.replay]]

    def run(self, cfg: Annotated[PipelineConfig, Reads("continue_", "deploy", "evaluate", "model", "train", "storage")],
            inputs, ctx) -> StageResult:
        from tasks.continued.cycle import CycleError
        from tasks.deploy.gate import write_gate_record
        from tasks.deploy.registry import get_champion
        from tasks.deploy.yardstick import against_champion, yardstick_rows

        champion = get_champion(ctx.tracking_uri, cfg.deploy.model_name)
        if champion is None:
            raise CycleError("the yardstick compares with the champion, and there is none")
        if not isinstance(inputs.replay, dict):
            # a bare list loses the hashes the champion's chain vouches for: a member written before indexes
            # were signed would then be refused for want of a signature, failing the cycle
            raise TypeError("the yardstick's pool must be vouched_pool's {token index: vouched sha256}, not a list")
        out = ctx.stage_dir(self.name)
        data = against_champion(cfg, ctx.tracking_uri, inputs.evaluation, inputs.tokenizer, champion, out,
                                new_index=inputs.tokens_index, pool=inputs.replay)
        write_gate_record(out / "gate.json", data)
        built, decision = data["set"], data["decision"]
        return StageResult(data, outputs=[dataset_for_path(built["path"], output=True, doc=DATASET_DOCS["yardstick"]),
                                          dataset_for_path(str(out / "gate.json"), output=True)],
                           reports=[Table("yardstick-gate", yardstick_rows(decision["checks"]), f"Champion vs challenger on the "
                                          f"yardstick {built['sha256'][:12]}: {decision['reason']}"[:500])])
