"""Building a release: the DVC stage plan and process control, the stage runners, and
quantisation with llm-compressor."""
