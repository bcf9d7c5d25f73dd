"""What a release is: the manifest schema, load profiles, prompt templates and rendering,
the lock and release id, git provenance, and validation."""
