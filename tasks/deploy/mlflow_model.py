"""The registered model as an MLflow pyfunc ("models from code": MLflow runs this file on load).

    import mlflow
    lm = mlflow.pyfunc.load_model("models:/crucible-tiny@champion")
    lm.predict(["The Linux kernel"], params={"max_tokens": 16, "temperature": 0})  # -> [completion]

Artifacts: "checkpoint" (the tasks.train.checkpoint directory) and "tokenizer" (tokenizer.json).
Loading needs the crucible package (tasks.train, tasks.deploy) importable.
"""
from __future__ import annotations

import mlflow
from mlflow.pyfunc import PythonModel

from tasks.deploy.generation import PYFUNC_PARAMS as PARAMS


class CrucibleLM(PythonModel):
    def load_context(self, context):
        from tasks.deploy.generation import TextGenerator

        # the export's tree hash recorded at registration: checked before the weights are read
        expected = (context.model_config or {}).get("export_sha256")
        if not expected:
            raise ValueError("the registered model records no export_sha256 to verify its checkpoint against")
        self.gen = TextGenerator.from_files(context.artifacts["checkpoint"], context.artifacts["tokenizer"],
                                            expected_tree_sha256=expected)

    # No type hints on purpose: MLflow would infer a signature from them that drops the params
    # schema; the signature (string in, string out, PARAMS) is given at registration instead.
    def predict(self, context, model_input, params=None):
        p = {**PARAMS, **(params or {})}
        if hasattr(model_input, "columns"):  # a DataFrame: the first column holds the prompts
            prompts = [str(x) for x in model_input[model_input.columns[0]]]
        elif isinstance(model_input, str):
            prompts = [model_input]
        else:
            prompts = [str(x) for x in model_input]
        seed = None if p["seed"] is None or int(p["seed"]) < 0 else int(p["seed"])
        return [self.gen.complete(self.gen.encode(text), max_tokens=int(p["max_tokens"]),
                                  temperature=float(p["temperature"]), top_p=float(p["top_p"]),
                                  seed=seed)[0].text for text in prompts]


mlflow.models.set_model(CrucibleLM())
