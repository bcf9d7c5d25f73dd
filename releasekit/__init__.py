"""releasekit: lock, build, register, promote, watch and audit self-hosted LLM releases."""

from __future__ import annotations

__version__ = "0.1.0"
