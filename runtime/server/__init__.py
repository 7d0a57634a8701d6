"""kiln.runtime.server: the OpenAI-compatible HTTP server (FastAPI + uvicorn)."""
