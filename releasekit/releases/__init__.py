"""The release record's verbs: resolve a reference, reconstruct a release's context,
register it, assign it to an environment (the only writer of "what runs where"), and the
auditor's queries (status, history, at, show, diff)."""
