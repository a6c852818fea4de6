"""Does training's node cache of token files pay? Reading training windows straight from the store
vs staging the file once (`tasks.train.remote.stage_tokens`) and reading the cached file.

A token file goes to S3 (moto's server mode, a separate process on 127.0.0.1: every byte over HTTP
with SigV4 signing). Then, for the same random windows of seq_len + 1 tokens that `GlobalWindows`
hands a micro-batch:
- direct: each window a ranged read of the object through the fsspec file training would open
  (`tasks.core.fs`, s3fs, block size of `fs.RANGED_READ` as for every other store read, and a
  small block too, which reads only the window);
- cached: `stage_tokens` once (download and sha256 check), then the windows from `np.memmap` of
  the cached file, as `GlobalWindows` reads them.
Reported: seconds per micro-batch each way, the staging time, and the steps after which staging
has paid for itself.

Writes benchmarks/results/token_cache.json.

    python benchmarks/token_cache.py [--mb 64] [--batches 20]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from _common import write_result
from object_store_demo import KEY_VAR, SECRET_VAR, start_moto
from tasks.config import StorageConfig
from tasks.core.fs import RANGED_READ, filesystem
from tasks.train.remote import stage_tokens

HERE = Path(__file__).resolve().parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=64, help="size of the token file")
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--out", default=str(HERE / "results" / "token_cache.json"))
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="crucible-bench-tokens-"))
    os.environ.update({KEY_VAR: "bench", SECRET_VAR: "bench", "AWS_EC2_METADATA_DISABLED": "true",
                       "AWS_DEFAULT_REGION": "us-east-1"})
    moto, endpoint = start_moto(tmp)
    try:
        options = {"endpoint_url": endpoint, "key": "${%s}" % KEY_VAR, "secret": "${%s}" % SECRET_VAR}
        fs = filesystem("s3", options)
        fs.mkdir("s3://tokens")
        n_tokens = args.mb * (1 << 20) // 2
        ids = np.random.default_rng(0).integers(0, 50_000, n_tokens, dtype=np.uint16)
        data = ids.tobytes()
        fs.pipe_file("s3://tokens/run/tokens/train.bin", data)
        index = {"dtype": "uint16", "vocab_size": 50_000, "splits": {"train": {
            "path": "train.bin", "tokens": n_tokens, "sha256": hashlib.sha256(data).hexdigest()}}}
        fs.pipe_file("s3://tokens/run/tokens/index.json", json.dumps(index).encode())

        rng = np.random.default_rng(1)
        span = args.seq_len + 1
        windows = [rng.integers(0, (n_tokens - span) // args.seq_len, args.micro_batch) * args.seq_len
                   for _ in range(args.batches)]

        def direct(block: int) -> float:
            t0 = time.perf_counter()
            with fs.open("s3://tokens/run/tokens/train.bin", "rb", block_size=block) as f:
                for starts in windows:
                    for s in starts:
                        f.seek(int(s) * 2)
                        np.frombuffer(f.read(span * 2), dtype=np.uint16).copy()
            return (time.perf_counter() - t0) / args.batches

        direct_block = direct(RANGED_READ)
        direct_small = direct(span * 2)
        storage = StorageConfig(options=options, cache_dir=str(tmp / "cache"))
        t0 = time.perf_counter()
        local_index, fetched = stage_tokens("s3://tokens/run/tokens/index.json", storage)
        staging = time.perf_counter() - t0
        assert fetched == 1
        path = json.loads(local_index.read_text())["splits"]["train"]["path"]
        t0 = time.perf_counter()
        mm = np.memmap(path, dtype=np.uint16, mode="r")
        for starts in windows:
            np.stack([np.asarray(mm[s:s + span]) for s in starts])
        cached = (time.perf_counter() - t0) / args.batches
    finally:
        moto.terminate()
        moto.wait(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)
    best_direct = min(direct_block, direct_small)
    result = {
        "store": "moto_server (separate process, HTTP, SigV4), 127.0.0.1",
        "token_file_mb": args.mb, "micro_batch": args.micro_batch, "seq_len": args.seq_len,
        "batches": args.batches,
        "direct_s_per_batch": {"block_8MiB": round(direct_block, 4), "block_window": round(direct_small, 4)},
        "staging_s": round(staging, 3),
        "cached_s_per_batch": round(cached, 6),
        "batches_to_repay_staging": round(staging / max(best_direct - cached, 1e-9), 1),
        "note": "direct reads: every window a ranged GET (latency-bound, and with an 8 MiB block most of "
                "each GET is thrown away); the node cache downloads once per node for all ranks and runs",
    }
    print(json.dumps(result, indent=2))
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
