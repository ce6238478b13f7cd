"""Server role: the OpenAI-compatible HTTP API (FastAPI + uvicorn), chat templates and tokenization.

`run_server` (process.py) is the entry the launcher spawns; `build_app` (app.py) builds the FastAPI
app around a `ServerState`, so tests drive it with TestClient. Never imports torch.cuda or model
code.
"""
