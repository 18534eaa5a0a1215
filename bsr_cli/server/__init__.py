"""The admin HTTP API (``/bsr/v1/...``, ``/metrics``) that every host of the BSR runtime serves.

FastAPI routes answering the runtime's result types, their request bodies pydantic models (app.py, models.py),
behind an ASGI guard that checks routing, the token and the body cap before a body is read (guard.py), served by
uvicorn in a thread with connection defences (protocol.py, admin.py); /metrics through prometheus_client
(metrics.py); the OpenAPI document generated from the app and the codec's schemas of its answers (openapi.py).
Hosts import ``bsr_cli.server.admin.AdminServer``; the CLI imports nothing from here.
"""
