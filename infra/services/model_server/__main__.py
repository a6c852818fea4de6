"""python -m infra.services.model_server --checkpoint DIR --tokenizer tokenizer.json --model-name NAME
[--host 127.0.0.1] [--port 8600]: serve a checkpoint (see server.py for the API)."""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from infra.services.model_server import server
from infra.services.model_server.server import create_app, log
from tasks.deploy.generation import TextGenerator


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m infra.services.model_server", description=server.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="checkpoint directory (tasks.train.checkpoint layout)")
    ap.add_argument("--tokenizer", required=True, help="tokenizer.json")
    ap.add_argument("--model-name", required=True, help="the model id clients send and /v1/models lists")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8600)
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--max-tokens-limit", type=int, default=1024)
    ap.add_argument("--max-n", type=int, default=16)
    ap.add_argument("--max-batch", type=int, default=32,
                    help="sequences decoded together (continuous batching); 1 = one at a time")
    ap.add_argument("--api-key-env", default=None,
                    help="name of the environment variable holding the bearer token clients must send")
    ap.add_argument("--log-level", default="info")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import torch
    import uvicorn

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    generator = TextGenerator.from_files(args.checkpoint, args.tokenizer)
    log.info("loaded %s (step %s, %d parameters) in %.1fs", args.checkpoint, generator.meta.get("step"),
             sum(p.numel() for p in generator.model.parameters()), time.perf_counter() - t0)
    api_key = None
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env) or None
        if api_key is None:
            log.warning("--api-key-env %s is not set: the server accepts requests without a key", args.api_key_env)
    app = create_app(generator, args.model_name, args.max_tokens_limit, args.max_n, api_key=api_key,
                     max_batch=args.max_batch)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower())
    return 0


if __name__ == "__main__":
    sys.exit(main())
