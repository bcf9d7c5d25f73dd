"""Helpers with no domain words: digests and canonical JSON, atomic writes, process groups
and signals, the progress protocol, URL redaction and dict flattening."""
