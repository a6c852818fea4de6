"""The command line every flow module shares: `python -m flows.X CONFIG [--set key=value ...]`."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

from infra.settings import load_config
from tasks.config import ConfigError, PipelineConfig


def run_flow_cli(prog: str, doc: str | None, run: Callable[[PipelineConfig, str | None], dict],
                 out_flag: str, out_help: str, shown: tuple[str, ...], argv: list[str] | None = None) -> int:
    """Parse CONFIG, `--set` overrides and one output-file flag; run the flow; print `shown` keys
    of its result as JSON. A bad config prints the validation error and returns 2."""
    parser = argparse.ArgumentParser(prog=prog, description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(out_flag, dest="out", default=None, help=out_help)
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    result = run(cfg, args.out)
    print(json.dumps({k: result.get(k) for k in shown}, indent=2))
    return 0
