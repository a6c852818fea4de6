"""The replay-mix stage of a continued-pretraining cycle: the cycle's new tokens plus replayed
documents of earlier cycles (tasks/continued/mix.py)."""
from __future__ import annotations

from pathlib import Path

from tasks.core.stage import Markdown, Stage, StageInputs, TokensResult
from tasks.lineage import dataset_for_path
from tasks.lineage.outputs import DATASET_DOCS


class ReplayMixStage(Stage):
    name, task, flow = "mix", "mix_replay", "prepare_tokens"
    reads = ("continue_",)
    doc = ("Build a continued-pretraining cycle's training mix: the new token shards plus whole documents replayed "
           "from earlier cycles' token shards, continue.replay_fraction of the tokens.")
    result_type = TokensResult

    def input_datasets(self, cfg, inputs: StageInputs) -> list:
        return [dataset_for_path(p) for p in [inputs.tokens_index, *inputs.replay]]

    def run(self, cfg, inputs, ctx) -> TokensResult:
        from tasks.continued.mix import build_mix

        c = cfg.continue_
        data = build_mix(inputs.tokens_index, [Path(p) for p in inputs.replay], c.replay_fraction, c.replay_seed,
                         ctx.stage_dir(self.name))
        mix = data["mix"]
        rows = "\n".join(f"| {v['role']} | `{origin}` | {v['docs']:,} | {v['tokens']:,} |"
                         for origin, v in mix["by_origin"].items())
        report = (f"**{mix['new_tokens']:,} new + {mix['replay_tokens']:,} replayed tokens** (replay share "
                  f"{mix['replay_share']:.3f}, configured {mix['replay_fraction']:.3f})\n\n"
                  f"| role | token index | docs | tokens |\n|---|---|---|---|\n{rows}\n")
        outputs = [dataset_for_path(data["index_path"], output=True, doc=DATASET_DOCS["tokens_mix"]),
                   dataset_for_path(data["splits"]["train"]["path"], output=True,
                                    doc=DATASET_DOCS["tokens_split"].format(split="train (mix)"),
                                    rows=data["splits"]["train"]["tokens"])]
        return TokensResult(data, outputs=outputs,
                            reports=[Markdown("training-mix", report, "New and replayed tokens of this cycle")])
