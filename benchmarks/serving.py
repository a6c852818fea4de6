"""Throughput and latency of the model server under 16 concurrent clients; print the figures and write
a JSON result to benchmarks/results/serving.json.

    .venv/bin/python benchmarks/serving.py [--clients 16] [--requests 96] [--max-tokens 32]

A real server process (`python -m infra.services.model_server`) on loopback serves a randomly initialised
GPT (the tiny config's shape, d_model 128, 4 layers, seq_len 128) saved with tasks.train's
checkpoint code. `--clients` threads send `--requests` non-streaming /v1/completions in total
(sampled, temperature 0.8, seeded per request, max_tokens fixed and no EOS cut-off worth
mentioning for a random model). Run twice: continuously batched (--max-batch = clients) and one
sequence at a time (--max-batch 1). Measured per mode: completion tokens/s over the wall time,
request latency p50/p99, and errors (any non-200 or transport error); the run fails if any.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from tokenizers import Tokenizer

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # lm_helpers: the random model the serving tests use too

from _common import write_result  # noqa: E402
from lm_helpers import random_checkpoint, sample_tokenizer  # noqa: E402
from tasks.core.net import free_port  # noqa: E402

MODEL = {"n_layer": 4, "n_head": 4, "d_model": 128, "seq_len": 128, "vocab_size": 512}


def make_model(root: Path) -> tuple[Path, Path]:
    tok_path = sample_tokenizer(root / "tokenizer.json", vocab_size=MODEL["vocab_size"])
    shape = {k: v for k, v in MODEL.items() if k != "vocab_size"}
    return random_checkpoint(root / "train", tok_path, 1, 0, run_name="bench", **shape), tok_path


def start_server(ckpt: Path, tok: Path, port: int, max_batch: int, threads: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "infra.services.model_server", "--checkpoint", str(ckpt), "--tokenizer", str(tok),
           "--model-name", "bench", "--port", str(port), "--threads", str(threads), "--max-batch", str(max_batch),
           "--log-level", "warning"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=REPO)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1, trust_env=False).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.terminate()
    raise RuntimeError("server did not become healthy")


def run_load(port: int, clients: int, requests: int, max_tokens: int) -> dict:
    url = f"http://127.0.0.1:{port}/v1/completions"
    latencies: list[float] = []
    tokens, errors, lock = [0], [], threading.Lock()
    counter = iter(range(requests))

    def worker():
        with httpx.Client(timeout=300, trust_env=False) as c:
            while True:
                with lock:
                    i = next(counter, None)
                if i is None:
                    return
                t0 = time.perf_counter()
                try:
                    r = c.post(url, json={"prompt": f"Request {i}: The Linux kernel", "max_tokens": max_tokens,
                                          "temperature": 0.8, "seed": i})
                    ok = r.status_code == 200
                    body = r.json() if ok else None
                except httpx.HTTPError as e:
                    ok, body, r = False, None, e
                dt = time.perf_counter() - t0
                with lock:
                    if ok:
                        latencies.append(dt)
                        tokens[0] += body["usage"]["completion_tokens"]
                    else:
                        errors.append(str(getattr(r, "text", r))[:200])

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    lat = sorted(latencies)

    def pct(p):
        return round(lat[min(len(lat) - 1, int(round(p / 100 * (len(lat) - 1))))] * 1000, 1) if lat else None

    return {"requests": requests, "ok": len(latencies), "errors": len(errors), "error_samples": errors[:3],
            "completion_tokens": tokens[0], "wall_s": round(wall, 3),
            "tokens_per_s": round(tokens[0] / wall, 1), "requests_per_s": round(len(latencies) / wall, 2),
            "latency_ms": {"p50": pct(50), "p99": pct(99), "mean": round(statistics.mean(lat) * 1000, 1) if lat else None}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the server")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "serving.json"))
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="crucible-bench-serving-") as tmp:
        ckpt, tok = make_model(Path(tmp))
        # the sample tokenizer learns fewer merges than asked for on its small text
        trained_vocab = Tokenizer.from_file(str(tok)).get_vocab_size()
        modes = {}
        for mode, max_batch in (("batched", args.clients), ("one_at_a_time", 1)):
            port = free_port()
            proc = start_server(ckpt, tok, port, max_batch, args.threads, Path(tmp) / f"{mode}.log")
            try:
                run_load(port, 2, 4, 4)  # warm-up
                res = run_load(port, args.clients, args.requests, args.max_tokens)
                res["max_batch"] = max_batch
                res["server_batching"] = httpx.get(f"http://127.0.0.1:{port}/health", trust_env=False).json()["batching"]
            finally:
                proc.terminate()
                proc.wait(30)
            modes[mode] = res
            print(f"{mode:>14}: {res['tokens_per_s']:8.1f} tok/s  p50 {res['latency_ms']['p50']} ms  "
                  f"p99 {res['latency_ms']['p99']} ms  errors {res['errors']}")
    result = {
        "benchmark": "serving", "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()},
        "model": {**MODEL, "vocab_size_requested": MODEL["vocab_size"], "vocab_size": trained_vocab},
        "load": {"clients": args.clients, "requests": args.requests, "max_tokens": args.max_tokens,
                 "temperature": 0.8, "server_threads": args.threads},
        "modes": modes,
        "speedup_tokens_per_s": round(modes["batched"]["tokens_per_s"] / modes["one_at_a_time"]["tokens_per_s"], 2),
    }
    write_result(args.out, result)
    print(f"speedup {result['speedup_tokens_per_s']}x; wrote {args.out}")
    return 1 if any(m["errors"] for m in modes.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
