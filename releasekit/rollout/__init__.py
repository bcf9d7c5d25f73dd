"""Progressive delivery: canary steps judged live against the stable release, and shadow
traffic; promote's deploy composed with watch's window and rule logic.

Modules
-------
- `judge`           one canary window against stable's: which figure is trusted, the limit
- `power`           what a check can detect at its min_samples, stated before it runs
- `figures`         the warm-up burst, scrapes of the gateway and both servers, their windows
- `step_verdicts`   a step's judgements counted (clean runs) and put in words
- `canary_records`  what a canary run records: steps, breaches, outcome
- `canary`          the step loop: weights (leased at the gateway), judgements, abort
- `state`           a canary in progress on disk (resume or abort after a crash)
- `progressive`     promote with canary steps, and the ledger events that record them
- `shadow_records`  the shadow's status, comparison and error, and their JSON copies
- `shadow_gates`    the admission before mirroring and the "shadow comparison" promote gate
- `shadow_compare`  judge the candidate against stable over a window of mirrored traffic
- `shadow`          mirror a share of requests to a candidate (start, stop) and compare it
- `report`          the shadow comparison as an HTML page
"""
