"""A folder put first on a vLLM server's PYTHONPATH on a CPU with AMX, so that its
`sitecustomize` runs in every Python process of the server (`serving.host.inherited_env`)."""

from pathlib import Path

STARTUP_DIR = Path(__file__).resolve().parent
