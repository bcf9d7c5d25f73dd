"""The vLLM process: ports, start, health, stop; serving a release with exactly its engine
arguments."""
