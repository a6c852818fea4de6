"""How Crucible starts and runs: the embedded stack (stack.py), the `crucible` command line (infra/cli/)
and the services (infra/services/: the lineage service and the model server)."""
