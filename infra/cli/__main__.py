"""python -m infra.cli: the `crucible` command."""
import sys

from infra.cli.main import main

sys.exit(main())
