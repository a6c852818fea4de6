"""The model server: an OpenAI-compatible completion API over a Crucible checkpoint, run as a
service of the local stack.

    server.py        the FastAPI app (python -m infra.services.model_server ...): completions with SSE
                     streaming and logprobs, bearer auth, POST /v1/admin/reload (hot swap)
    scheduler.py     continuous batching: one thread steps all active sequences together
    supervisor.py    serve_model / start_or_refresh_server: the server as a background service of the
                     stack (a new champion is swapped into the running server in place)
    identity.py      the server's proof that it holds the admin key (a nonce answered with an HMAC),
                     asked before the stack or the supervisor trusts or sends anything to the port

The sampling loop itself (tasks/deploy/generation.py) is shared with evaluation and the registered
MLflow model. Importing this package is cheap: the supervisor needs neither torch nor FastAPI.
"""
