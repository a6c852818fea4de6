"""Local infrastructure: the embedded stack (stack.py) and the `crucible` command line (cli.py)."""
