"""The tokens stage: encode the curated corpus and pack it into train/validation token shards."""
from __future__ import annotations

from pathlib import Path

from tasks.core.stage import Stage, TokensResult
from tasks.lineage import dataset_for_path
from tasks.lineage.outputs import DATASET_DOCS


class TokensStage(Stage):
    name, task, flow = "tokens", "encode_and_pack", "prepare_tokens"
    reads = ("tokens",)
    doc = "Encode the curated shards with the tokenizer and pack the token ids into train/validation shards."
    result_type = TokensResult

    def run(self, cfg, inputs, ctx) -> TokensResult:
        from tasks.tokens import prepare_tokens

        data = prepare_tokens(cfg, Path(inputs.tokenizer), [Path(p) for p in inputs.shards], ctx.stage_dir(self.name))
        splits = data["splits"]
        outputs = [dataset_for_path(data["index_path"], output=True, doc=DATASET_DOCS["tokens_index"])]
        outputs += [dataset_for_path(s["path"], output=True, doc=DATASET_DOCS["tokens_split"].format(split=name),
                                     rows=s.get("tokens")) for name, s in splits.items()]
        # document start offsets: training reads them for document-aware attention masks
        outputs += [dataset_for_path(s["doc_starts"], output=True) for s in splits.values()]
        # each document's data source (per-source token counts; a continued cycle's mix reports them)
        outputs += [dataset_for_path(s["doc_sources"], output=True) for s in splits.values()]
        return TokensResult(data, outputs=outputs)
