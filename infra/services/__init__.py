"""Long-running services of the local stack (infra/stack.py starts them): the lineage service and
the model server. They may import tasks, never flows."""
