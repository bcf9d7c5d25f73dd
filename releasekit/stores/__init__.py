"""Where facts live: the event ledger, the MLflow adapter (a pure adapter: no use cases),
and the results/<release id>/ folder with its evidence files."""
