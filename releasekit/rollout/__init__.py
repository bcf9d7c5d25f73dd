"""Progressive delivery: canary steps judged live against the stable release, and shadow
traffic; promote's deploy composed with watch's window and rule logic.

Modules
-------
- `judge`        one canary window against stable's: which figure is trusted, the limit
- `power`        what a check can detect at its min_samples, stated before it runs
- `canary`       the step loop: weights (leased at the gateway), judgements, abort
- `state`        a canary in progress on disk (resume or abort after a crash)
- `progressive`  promote with canary steps, and the ledger events that record them
- `shadow`       mirror a share of requests to a candidate and compare it with stable
"""
