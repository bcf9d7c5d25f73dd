"""Promotion: gates over a release's evidence against what is live (the only owner of the
metric names gates use), promote and rollback."""
