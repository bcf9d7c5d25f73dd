"""Auditing recorded decisions: replaying a promotion's gate verdicts from its verified inputs
(`releasekit.audit.replay`). Sits above promote, rollout and watch, below the CLI."""
