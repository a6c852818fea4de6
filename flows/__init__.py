"""Prefect flows of the pipeline."""
from tasks.tracking.links import rewrite_prefect_log_links

# every flow entry point imports this package before a flow runs (`python -m flows.X`, `crucible run`,
# the stack's worker running a deployment): Prefect's "View at" line then names the page through the
# UI's login route, as every other printed link does (a deep link fails in a browser not logged in)
rewrite_prefect_log_links()
