"""The stages only a continued-pretraining cycle runs: the replay mix (the cycle's new tokens plus
replayed documents of earlier cycles, tasks/continued/mix.py) and the fixed yardstick both the
champion and the challenger are scored on (tasks/continued/yardstick.py)."""
from __future__ import annotations

import json
from pathlib import Path

from tasks.core.stage import Markdown, Stage, StageInputs, StageResult, Table, TokensResult
from tasks.lineage import dataset_for_path
from tasks.lineage.outputs import DATASET_DOCS


class ReplayMixStage(Stage):
    name, task, flow = "mix", "mix_replay", "replay_mix"
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
        # top-level numbers become the stage's MLflow metrics; tokens by origin are in data["mix"]["by_origin"]
        data.update(new_tokens=mix["new_tokens"], replay_tokens=mix["replay_tokens"], replay_share=mix["replay_share"])
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


class YardstickStage(Stage):
    name, task, flow = "yardstick", "score_yardstick", "gate_and_deploy"
    reads = ("continue_", "evaluate")
    doc = ("Score the champion and the best checkpoint of a continued-pretraining cycle on one pinned evaluation set "
           "(earlier cycles' held-out text, this cycle's, WikiText-2) in bits per byte, and decide the gate: better "
           "on the new data, no forgetting of the old.")

    def input_datasets(self, cfg, inputs: StageInputs) -> list:
        return [dataset_for_path(p) for p in [inputs.evaluation["checkpoint"], inputs.tokenizer, inputs.tokens_index,
                                              *inputs.replay]]

    def run(self, cfg, inputs, ctx) -> StageResult:
        from tasks.continued.cycle import CycleError, find_champion
        from tasks.continued.yardstick import ACCURACY, build_yardstick, decide, score

        champion = find_champion(cfg, ctx.tracking_uri)
        if champion is None:
            raise CycleError("the yardstick compares with the champion, and there is none")
        out = ctx.stage_dir(self.name)
        evaluation = inputs.evaluation
        built = build_yardstick(cfg, inputs.tokenizer, inputs.tokens_index, inputs.replay, out / "yardstick.jsonl")
        batch = cfg.evaluate.task_batch_size
        challenger = score(evaluation["checkpoint"], inputs.tokenizer, built["path"], batch)
        champion_bpb = score(champion.checkpoint, champion.tokenizer, built["path"], batch)
        challenger_acc = {m: (evaluation.get("task_metrics") or {}).get(m) for m in ACCURACY}
        champion_acc = {m: float(champion.tags[f"eval.{m}"]) for m in ACCURACY if f"eval.{m}" in champion.tags}
        decision = decide(cfg.continue_, challenger, champion_bpb, challenger_acc, champion_acc)
        data = {"set": built, "challenger": {"checkpoint": evaluation["checkpoint"], "bits_per_byte": challenger},
                "champion": {"version": champion.version, "checkpoint": str(champion.checkpoint),
                             "content_hash": champion.tags.get("content_hash"), "bits_per_byte": champion_bpb},
                "decision": decision}
        (out / "gate.json").write_text(json.dumps(data, indent=2) + "\n")
        rows = [{"check": k["check"], "part": k["part"], "challenger": round(k["challenger"], 4),
                 "champion": round(k["champion"], 4), "passed": k["ok"], "rule": k["rule"]} for k in decision["checks"]]
        return StageResult(data, outputs=[dataset_for_path(built["path"], output=True, doc=DATASET_DOCS["yardstick"]),
                                          dataset_for_path(str(out / "gate.json"), output=True)],
                           reports=[Table("yardstick-gate", rows, f"Champion vs challenger on the yardstick "
                                          f"{built['sha256'][:12]}: {decision['reason']}"[:500])])
