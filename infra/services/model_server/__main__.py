"""python -m infra.services.model_server --checkpoint DIR --tokenizer tokenizer.json --model-name NAME
[--host 127.0.0.1] [--port 8600] [--api-key-file F] [--admin-key-file F]: serve a checkpoint (see
server.py for the API; keys are passed as file paths, never as values)."""
from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

from infra.services.model_server import server
from infra.services.model_server.server import create_app, log
from tasks.deploy.generation import TextGenerator


def read_secret(env_name: str | None, key_file: str | None, what: str) -> str | None:
    """The token named by an environment variable or held in a file; a source that is named but
    empty or missing stops the server (it never falls back to serving without the token)."""
    if env_name:
        value = os.environ.get(env_name, "").strip()
        if not value:
            raise SystemExit(f"model server: {what} environment variable {env_name} is empty or not set; refusing "
                             "to start without the token it names (set it, or drop the setting)")
        return value
    if key_file:
        try:
            value = Path(key_file).read_text().strip()
        except OSError as e:
            raise SystemExit(f"model server: cannot read the {what} file {key_file}: {e}") from None
        if not value:
            raise SystemExit(f"model server: the {what} file {key_file} is empty; refusing to start")
        return value
    return None


def version_resolver(tracking_uri: str, model_name: str, cache_dir: Path):
    """How /v1/admin/reload finds a registered version: MLflow's registry, files verified."""
    def resolve(version: int | None, alias: str | None):
        from tasks.deploy.registry import get_version, registered_files

        found = get_version(tracking_uri, model_name, version, alias)
        ckpt, tok, copy_hash = registered_files(tracking_uri, model_name, found, cache_dir)
        return str(ckpt), str(tok), copy_hash, found["version"]
    return resolve


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m infra.services.model_server", description=server.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="checkpoint directory (tasks.train.checkpoint layout)")
    ap.add_argument("--tokenizer", required=True, help="tokenizer.json")
    ap.add_argument("--model-name", required=True, help="the model id clients send and /v1/models lists")
    ap.add_argument("--version", type=int, default=None, help="the registered version the checkpoint is")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8600)
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--max-tokens-limit", type=int, default=1024)
    ap.add_argument("--max-n", type=int, default=16)
    ap.add_argument("--max-batch", type=int, default=32,
                    help="sequences decoded together (continuous batching); 1 = one at a time")
    ap.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (413 above)")
    ap.add_argument("--max-streams", type=int, default=64, help="concurrent streamed completions (429 above)")
    ap.add_argument("--max-requests", type=int, default=32,
                    help="concurrent non-streamed completions (429 above, at once)")
    ap.add_argument("--request-timeout", type=float, default=300.0,
                    help="seconds a non-streamed completion may take (503 after; its choices are cancelled)")
    key = ap.add_mutually_exclusive_group()
    key.add_argument("--api-key-file", default=None,
                     help="file holding the bearer token clients must send (the stack's: secrets/model-server.api-key)")
    key.add_argument("--api-key-env", default=None,
                     help="name of the environment variable holding the bearer token clients must send")
    ap.add_argument("--admin-key-file", default=None,
                    help="file holding the admin API's bearer token (never the clients' key); none: admin API off")
    ap.add_argument("--tracking-uri", default=None, help="MLflow registry that /v1/admin/reload resolves versions in")
    ap.add_argument("--cache-dir", default=None, help="where registered copies are downloaded when a version's own "
                                                      "files are gone (default: a private temporary directory)")
    ap.add_argument("--log-level", default="info")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    api_key = read_secret(args.api_key_env, args.api_key_file, "the API key")
    admin_key = read_secret(None, args.admin_key_file, "admin key")

    import torch
    import uvicorn

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    generator = TextGenerator.from_files(args.checkpoint, args.tokenizer)
    log.info("loaded version %s (step %s, %d parameters) in %.1fs", args.version, generator.meta.get("step"),
             sum(p.numel() for p in generator.model.parameters()), time.perf_counter() - t0)
    # default: a private (0700) directory of this process, never a predictable shared one
    cache = Path(args.cache_dir or tempfile.mkdtemp(prefix="crucible-registered-copies-"))
    resolve = version_resolver(args.tracking_uri, args.model_name, cache) if args.tracking_uri else None
    app = create_app(generator, args.model_name, args.max_tokens_limit, args.max_n, api_key=api_key,
                     max_batch=args.max_batch, admin_key=admin_key, resolve_version=resolve, version=args.version,
                     max_body_bytes=args.max_body_bytes, max_streams=args.max_streams,
                     max_requests=args.max_requests, request_timeout=args.request_timeout)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower())
    return 0


if __name__ == "__main__":
    sys.exit(main())
