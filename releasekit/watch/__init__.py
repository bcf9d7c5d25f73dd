"""Watching live releases: metric windows from /metrics scrapes, watch rules, the watcher loop
that rolls back on a sustained breach, the Alertmanager webhook receiver, and generated
Prometheus alerting rules.

Modules:
    windows     scrape Prometheus text; turn two scrapes into a `Window` of figures
    rules       the watch-rule model, benchmark baselines, per-window judgements, `RuleState`
    watcher     `Watcher` (scrape, judge, roll back), `RollbackGuard` (cool-down, known-good),
                the `RollbackRequest` / `RollbackOutcome` contract with the rollback path
    receiver    Alertmanager webhook receiver (Starlette app) with durable deduplication
    alertrules  Prometheus alerting rules and the Alertmanager snippet for an environment
    pairs       after a promotion, the live release's answers judged against the previous one's
    plan        what a watch of an environment judges: live release, rules, baseline, URLs
    rollbacks   the rollback path (adapter to promote's rollback) and the guard's look-ups
    webhook     the receiver's path, credentials from the environment, delivery store
    alertfiles  `alert-rules ENV`: the rules file, Alertmanager snippet and scrape jobs
    service     `WatchService`: the plan, guard, watcher and receiver of one environment

Errors (all `releasekit.errors.ReleasekitError`):
    ScrapeError             windows: a /metrics endpoint did not answer usable text in time
    WatchRuleError          rules: a watch rule names an unknown metric or is inconsistent
    RollbackTransientError  watcher: raised by a rollback callback when a retry could succeed
    ReceiverConfigError     receiver: the receiver was configured without credentials
    WatchSetupError         plan: the environment cannot be watched (nothing live, no server)
"""
