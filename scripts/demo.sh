#!/usr/bin/env bash
# The main job on the demo: install, make the demo data (the model is shipped), then take the demo releases
# through the whole lifecycle: validate, lock, build (quantise, bench + eval on one server,
# report), register in MLflow, promote behind gates to staging and production through a
# real gateway, block a bad prompt, roll back, and answer the auditor's questions.
# It ends with both environments serving; `releasekit down staging` / `down production`
# stops them.
#
# The log tells the story in a few hundred lines: each step is one header line; noisy tools
# (install, system packages, DVC, key generation, validation) write to
# .releasekit/demo-logs/ and print one line, or their log's tail when they fail. Step times
# go to .releasekit/demo-steps.tsv and each decision to .releasekit/demo-outcomes.jsonl;
# the demo ends with the outcome table and where the time went (scripts/demo_outcome.py).
#
# DEMO_PARTS=adapters bash scripts/demo.sh runs the set-up, then the LoRA adapters part alone
# (its three releases in a staging with nothing live before them), then the audit.
# DEMO_PARTS=answers runs the set-up, demo-canary-good promoted to staging, then the
# live-answers part alone (the prompt fix kept, v2-1 rolled back, v2 refused), then the audit.
set -euo pipefail
DEMO_PARTS=${DEMO_PARTS:-all}
case "$DEMO_PARTS" in all | answers | adapters) ;; *) echo "DEMO_PARTS must be all, answers or adapters" >&2; exit 2 ;; esac
cd "$(dirname "$0")/.."
mkdir -p .releasekit/demo-logs
export DEMO_STEPS="$PWD/.releasekit/demo-steps.tsv" DEMO_OUTCOMES="$PWD/.releasekit/demo-outcomes.jsonl"
: >"$DEMO_STEPS"
: >"$DEMO_OUTCOMES"
DEMO_STEP=""
STEP_STARTED=$SECONDS
step_end() {  # the running step's time, into the steps file
  if [ -n "$DEMO_STEP" ]; then
    printf '%s\t%s\n' "$((SECONDS - STEP_STARTED))" "$DEMO_STEP" >>"$DEMO_STEPS"
  fi
}
step() {  # step TITLE: end the running step, print one header line, start timing this one
  step_end
  export DEMO_STEP="$*"
  STEP_STARTED=$SECONDS
  printf '\033[1m== %s\033[0m\n' "$*"
}
quiet() {  # quiet NAME CMD...: CMD's output goes to a log; one line, or the log's tail on failure
  local name=$1 log=".releasekit/demo-logs/$1.log" started=$SECONDS rc=0
  shift
  "$@" >"$log" 2>&1 || rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "$name: FAILED (exit $rc); the last 40 lines of $log:"
    tail -n 40 "$log"
    return "$rc"
  fi
  echo "$name: ok ($((SECONDS - started)) s; log: $log)"
}
BG=()  # background helpers (traffic, listener, watcher), stopped on exit
on_exit() {  # stop the helpers; the outcome table and where the time went, also after a stop
  local rc=$?
  [ ${#BG[@]} -eq 0 ] || kill "${BG[@]}" 2>/dev/null || true
  step_end
  DEMO_STEP=""
  if [ -s "$DEMO_STEPS" ]; then
    echo
    python3 scripts/demo_outcome.py table || true
  fi
  exit "$rc"
}
trap on_exit EXIT
step "setup: install the toolkit, and the system packages vLLM's CPU build and watch need"
quiet install bash scripts/install.sh
export PATH="$PWD/.venv/bin:$PATH" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# Piped into a log, output wraps at COLUMNS (80 unless set): the demo's log is read wide.
export COLUMNS="${COLUMNS:-120}"
export RELEASEKIT_ACTOR="${RELEASEKIT_ACTOR:-demo <demo@releasekit.local>}"
# A decision the step's exit status announces (demo_expect.py records those the ledger shows).
note() { python scripts/demo_outcome.py note "$@"; }
# Every promotion goes through the gates. One that fails stops the demo here: promote has
# printed the gate report (and where its HTML is), which says what failed and why.
promote_or_stop() {
  if ! releasekit promote --brief "$@"; then
    echo "demo: stopped, a gate failed (report above). Nothing was overridden." >&2
    exit 1
  fi
}
# A shadow in staging: mirror a quarter of its requests to MANIFEST, compare (40 s windows,
# up to 160 s), stop mirroring; the demo stops, naming WHAT, unless the comparison passed.
# With KEEP, a passed shadow keeps running: the promotion that follows takes its servers.
shadow_or_stop() {  # shadow_or_stop MANIFEST REASON WHAT [KEEP]
  releasekit shadow start "$1" --env staging --share 0.25 --reason "$2"
  if ! releasekit shadow compare --env staging --window 40 --max-window 160; then
    releasekit shadow stop --env staging
    echo "demo: stopped, $3's shadow comparison did not pass (figures above); nothing was forced" >&2
    exit 1
  fi
  [ -n "${4:-}" ] || releasekit shadow stop --env staging
}
# A gate that blocks is the point of some steps: show it, keep going.
expect_blocked() { if "$@"; then echo "(unexpected: this promotion passed)"; exit 1; fi; }
# Sign an approval of each release for staging with the demo approver's key; one line for all.
approve_all() {  # approve_all REASON MANIFEST...
  local reason=$1 names=() m
  shift
  for m in "$@"; do
    releasekit approve "$m" --env staging --key "$APPROVER_KEY" --reason "$reason" >/dev/null
    names+=("$(basename "$m" .yaml)")
  done
  echo "approved for staging by the demo approver ($reason): ${names[*]}"
}
# Each step names the decision it announces; the ledger says what decided, and the demo
# stops, naming the gate report, when it was another gate (scripts/demo_expect.py).
expect() { python scripts/demo_expect.py "$@" || exit 1; }

quiet system-deps bash scripts/system-deps.sh  # tcmalloc for vLLM's CPU build (and Prometheus for `watch`)

step "the team's server: a bare repository under .releasekit/ that this branch tracks (the protected ref)"
# Policy, trusted keys and approvers are read only from commits on the protected ref, the
# branch as fetched from the team's server (docs/concepts/ledger.md, "Trust root"); a local commit counts for
# nothing. The demo stands in for that server with a bare repository, and lands its key and
# approver commits there by pushing, as a reviewed merge would.
TEAM_REPO="$PWD/.releasekit/team.git"
BRANCH=$(git symbolic-ref --quiet --short HEAD || true)
if [ -z "$BRANCH" ]; then
  BRANCH=releasekit-demo
  git checkout -q -B "$BRANCH"
fi
[ -d "$TEAM_REPO" ] || git init -q --bare --initial-branch="$BRANCH" "$TEAM_REPO"
git remote get-url team >/dev/null 2>&1 || git remote add team "$TEAM_REPO"
git push -q team "HEAD:refs/heads/$BRANCH"
git fetch -q team
git branch -q --set-upstream-to="team/$BRANCH"
land() {  # land MESSAGE PATH...: commit the paths, push the commit to the team's branch, fetch
  local message=$1
  shift
  git add -- "$@"
  git -c user.name="releasekit demo" -c user.email="demo@releasekit.local" \
    commit -q -m "$message" -- "$@"
  git push -q team "HEAD:refs/heads/$BRANCH"
  git fetch -q team
}

step "signing key: the ledger is signed, and the repository trusts the public key landed on team/$BRANCH"
if ! compgen -G ".releasekit/keys/*.pem" >/dev/null; then
  quiet ledger-keygen releasekit ledger keygen
fi
KEY_ID=$(basename "$(ls .releasekit/keys/*.pem | head -n 1)" .pem)
if ! git cat-file -e "HEAD:keys/$KEY_ID.pub" 2>/dev/null; then
  land "Trust the demo's ledger signing key $KEY_ID" "keys/$KEY_ID.pub"
fi

step "demo data: dvc repro demo-data; the demo model is shipped in git (models/demo-base)"
quiet dvc-repro-demo-data dvc repro demo-data

# Releases on one engine come one after another: the damaged prompt (bf16's engine) cites
# bf16's load test and runs its suites on the server bf16's build left running.
MANIFESTS=(manifests/demo-bf16.yaml manifests/demo-damaged-prompt.yaml manifests/demo-w8a8.yaml
  manifests/demo-v2.yaml manifests/demo-v2-1.yaml)
# vLLM's CPU build serves W4A16 (its cpu_gemm_wna16 kernel) only on CPUs with AVX-512.
W4=no
if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then
  W4=yes; MANIFESTS+=(manifests/demo-w4a16.yaml)
else
  echo "note: this CPU has no AVX-512, which vLLM's CPU build needs to serve W4A16: skipping demo-w4a16"
fi
[ "$DEMO_PARTS" = all ] || MANIFESTS=()  # the adapters part builds its own
FIX=manifests/demo-prompt-fix.yaml
if [ "$DEMO_PARTS" = answers ]; then  # the live-answers part alone, from staging's release
  MANIFESTS=(manifests/demo-canary-good.yaml "$FIX" manifests/demo-v2.yaml manifests/demo-v2-1.yaml)
fi
step "validate the demo manifests (serving args against vLLM's own parser)"
[ ${#MANIFESTS[@]} -eq 0 ] || quiet validate releasekit validate "${MANIFESTS[@]}"

step "lock: one content-addressed release per manifest"
for m in "${MANIFESTS[@]}"; do
  printf '%-40s %s\n' "$m" "$(releasekit lock "$m")"
done

step "build: quantise, load-test and evaluate on one server (a release on an engine already measured cites its load test and runs on its server), compare with bf16, register"
[ ${#MANIFESTS[@]} -eq 0 ] || releasekit build "${MANIFESTS[@]}"

step "approvals: staging takes no release without one (requires_approval in the committed releasekit.toml)"
# An approval counts only when signed with the key of one of staging's `approvers` (named in
# releasekit.toml, public key under keys/, both on the protected ref), never with the key
# promote signs with: the demo's approver has a key of their own, made once, and the commit
# that names it lands on team/$BRANCH as a reviewed change would.
APPROVER_KEY=.releasekit/approver/approver.pem
if [ ! -f "$APPROVER_KEY" ]; then
  releasekit ledger keygen --private "$APPROVER_KEY" >/dev/null
fi
APPROVER_ID=$(python -c 'import sys; from pathlib import Path; from releasekit.stores.signing import load_private_key; print(load_private_key(Path(sys.argv[1])).key_id)' "$APPROVER_KEY")
python - "$APPROVER_ID" <<'PY'
import re, sys
from pathlib import Path
kid, toml = sys.argv[1], Path("releasekit.toml")
text = toml.read_text()
start = re.search(r"(?m)^\[environments\.staging\]\n", text).end()
end = text.find("\n[", start)
end = len(text) if end < 0 else end + 1
section = text[start:end]
line = f'approvers = ["{kid}"]  # the demo approver: keys/{kid}.pub\n'
if line not in section:
    section = line + re.sub(r"(?m)^approvers\s*=.*\n", "", section)
    toml.write_text(text[:start] + section + text[end:])
PY
if ! git diff --quiet HEAD -- releasekit.toml || ! git cat-file -e "HEAD:keys/$APPROVER_ID.pub" 2>/dev/null; then
  land "Name the demo's approver $APPROVER_ID for staging" "keys/$APPROVER_ID.pub" releasekit.toml
fi
# An approval lets a release be judged, not pass: the damaged prompt is approved too, and
# its quality gates still block it below.
[ ${#MANIFESTS[@]} -eq 0 ] || approve_all "demo: reviewed its build report" "${MANIFESTS[@]}"

STAGING_GW=$(python -c "from releasekit.config import load_settings as l; print(l().environments['staging'].url)")
if [ "$DEMO_PARTS" = answers ]; then
step "demo-canary-good to staging: the release the live-answers part starts from"
promote_or_stop manifests/demo-canary-good.yaml --to staging --no-canary --reason "demo: staging's release"
expect promoted staging manifests/demo-canary-good.yaml
fi
if [ "$DEMO_PARTS" = all ]; then
step "promote bf16 to staging (through every gate)"
promote_or_stop manifests/demo-bf16.yaml --to staging --reason "demo: baseline"
expect promoted staging manifests/demo-bf16.yaml

# The damaged prompt is bf16 with one prompt edited: it is tried while bf16 is live, so the
# comparison differs in the prompt alone (same weights, same serving parameters, same
# host); against the W8A8 release its speed would be judged too, and bf16 is slower than
# W8A8 on a CPU without native bf16.
# Its few-shot line also lengthens every prompt, so its load test can be slower than bf16's
# as well: the perf gates may fail beside the suites, and the demo expects the suites.
step "try the damaged prompt against live bf16: its quality gates block it, core among them"
expect_blocked releasekit promote --brief manifests/demo-damaged-prompt.yaml --to staging --reason "demo: a bad prompt edit"
expect blocked staging manifests/demo-damaged-prompt.yaml --by "suite core" --by "suite facts"

step "promote bf16 on to production (through every gate)"
promote_or_stop manifests/demo-bf16.yaml --to production --reason "demo: baseline"
expect promoted production manifests/demo-bf16.yaml

step "quantisation ladder: W8A8, W4A16, a 4-bit head, then short calibration rows; each against bf16 item by item, down to the first loss on facts"
# manifests/ladder/demo.yaml lists the recipes, most faithful first; each rung is a release
# (built, or reused as built above), compared with bf16 on every suite, priced from its own
# knee. The ladder stops at the first rung inferior on `facts` (critical in demo-bf16) and
# recommends the cheapest rung above it. A rung this CPU cannot serve says so and is skipped.
releasekit quantise ladder manifests/demo-bf16.yaml --recipes manifests/ladder/demo.yaml --brief
PICK=$(python -c 'import json, sys; print(json.load(open(sys.argv[1]))["recommended_manifest"] or "")' .releasekit/ladder/demo/ladder.json)
STOP=$(python -c 'import json, sys; print(json.load(open(sys.argv[1]))["stop_reason"] or "")' .releasekit/ladder/demo/ladder.json)
if [ -n "$STOP" ]; then note "ladder ${STOP%%:*}" --by "${STOP#*: }"; fi
if [ -z "$PICK" ]; then
  echo "demo: stopped, the ladder recommends no rung, not even bf16 (table above)." >&2
  exit 1
fi
note "ladder recommends $(basename "$PICK" .yaml)" --by "the ladder's rule (cheapest rung that passes every suite)"

if [ "$PICK" = manifests/demo-bf16.yaml ]; then
  # A host where bf16 serves clearly cheaper than every quantised rung (beyond the tolerance
  # and the runs' own spread): nothing to promote over it, and so nothing to roll back.
  echo "the ladder keeps bf16 on this host: no quantised rung is promoted, staging and production stay on bf16"
else
step "promote the ladder's pick ($(basename "$PICK" .yaml)) over bf16: staging, then production (through every gate)"
releasekit approve "$PICK" --env staging --key "$APPROVER_KEY" --reason "demo: the ladder's pick" >/dev/null
promote_or_stop "$PICK" --to staging --reason "demo: the quantisation ladder's pick"
expect promoted staging "$PICK"
promote_or_stop "$PICK" --to production --reason "demo: the quantisation ladder's pick"
expect promoted production "$PICK"

step "roll staging back to the release live before (the one rolled back from is marked bad)"
releasekit rollback staging --reason "demo: roll back to the previous release"
note "rolled back in staging" --by "releasekit rollback (no gates)"
fi

# ---- progressive delivery: canary steps, a canary abort, webhooks, an approval --------
# Under steady streaming load through staging's gateway: staging refuses a release until
# someone approves it, and lets canary steps that judge latency below 100% judge
# performance live (`requires_approval` and `perf_by_canary` in the committed
# releasekit.toml; nothing here changes policy); a
# healthy release is mirrored a share of live requests (shadow) and compared with stable,
# then goes to 100% in canary steps; a `max-num-seqs: 1` release is blocked by
# its offline perf gates without a canary and aborted by its canary at the first step with
# one; every event reaches a local webhook listener. Release ids come from `lock`, never
# from this file.
release_id() { releasekit lock "$1" --json | python -c 'import json, sys; print(json.load(sys.stdin)["release_id"])'; }
CANARY_GOOD=manifests/demo-canary-good.yaml
CANARY_SEQS1=manifests/demo-canary-seqs1.yaml
GOOD_ID=$(release_id "$CANARY_GOOD")
SEQS1_ID=$(release_id "$CANARY_SEQS1")
step "canary releases and a prompt fix: build them (their gates are as real as every other release's)"
releasekit build "$CANARY_GOOD" "$FIX" "$CANARY_SEQS1"  # the fix: canary-good's engine

step "webhooks: a local listener, subscribed for the rest of the demo"
HOOKS_LOG=.releasekit/demo-webhooks.jsonl
rm -f "$HOOKS_LOG"
HOOK_PORT=${DEMO_HOOK_PORT:-8790}
python scripts/webhook_listener.py --port "$HOOK_PORT" --out "$HOOKS_LOG" >.releasekit/demo-webhooks.out 2>&1 &
LISTENER=$!
# The same as a [[webhooks]] entry with this url in releasekit.toml.
export RELEASEKIT_WEBHOOKS="[{\"url\": \"http://127.0.0.1:$HOOK_PORT/hook\"}]"
python scripts/demo_traffic.py --url "$STAGING_GW" --clients 6 >.releasekit/demo-traffic.out 2>&1 &
TRAFFIC=$!
BG=("$TRAFFIC" "$LISTENER")
sleep 5

step "approvals: staging takes no release without one"
expect_blocked releasekit promote --brief "$CANARY_GOOD" --to staging --reason "demo: before approval"
note "blocked in staging: demo-canary-good" --by "approved for staging (no approval yet)"
approve_all "demo: reviewed its build report; its gates and canary decide" "$CANARY_GOOD" "$CANARY_SEQS1" "$FIX"

step "shadow: mirror a quarter of staging's requests to ${GOOD_ID:0:12} (its answers reach no client), compare it with stable"
# Real requests before it takes any: its server starts beside staging's, the gateway copies
# 25% of admitted requests to it (no client waits for a copy) and keeps both answers of each
# copied request (and a second copy to a fresh server of stable: the answers' noise floor),
# and `compare` judges it with its canary checks and its answers' excess over that floor
# (the policy's max_excess_disagreement) over 40 s, and on, 40 s at a time up to 160 s, until
# the answers are decided: a host that serves fewer requests a second takes longer, not a
# different verdict. The comparison is a signed ledger event bound
# to the stable release: promote reads it as a gate.
shadow_or_stop "$CANARY_GOOD" "demo: real traffic before it takes any" "the healthy release" keep
note "shadow passed in staging: demo-canary-good" --by "canary checks and answers (excess over their A/A floor)"

step "canary: promote ${GOOD_ID:0:12} to staging in steps (25% -> 50% -> 100%) under 6 streaming clients, on the servers its shadow ran"
# Its shadow still runs: the promotion takes the candidate's server and the fresh baseline
# beside it (started together, loaded alike), so the canary judges the pair the shadow did.
if ! releasekit promote --brief "$CANARY_GOOD" --to staging --reason "demo: canary steps"; then
  releasekit shadow stop --env staging
  echo "demo: stopped, the healthy release was not promoted (the gate report or canary_aborted event above names the figures; nothing was forced)" >&2
  exit 1
fi
releasekit shadow stop --env staging  # the mirror ended with the promotion; this records it
note "promoted in staging: demo-canary-good" --by "every gate, then each canary step"

step "max-num-seqs 1 without canary steps: its offline perf gates block it (the load sweep queues)"
expect_blocked releasekit promote --brief "$CANARY_SEQS1" --to staging --no-canary --reason "demo: one switch"
expect blocked staging "$CANARY_SEQS1" --by "ttft_p95_s at the knee"

step "max-num-seqs 1 with canary steps: staging lets the canary judge it on live traffic"
if releasekit promote --brief "$CANARY_SEQS1" --to staging --reason "demo: a serving change that queues"; then
  echo "(unexpected: the max-num-seqs 1 release was promoted)"; exit 1
fi
# Its canary was aborted on a breach: the ledger says so, with the figures.
python - "$SEQS1_ID" <<'PY'
import sys
from releasekit.config import load_settings
from releasekit.stores.ledger import open_ledger

sys.path.insert(0, "scripts")
from demo_outcome import record

led = open_ledger(load_settings(), read_only=True)
rid = sys.argv[1]
ab = [r for r in led.records(environment="staging", types=["canary_aborted"]) if r.to_release == rid]
if not ab or not ab[-1].evidence.get("breaches"):
    last = [r for r in led.records(environment="staging") if r.to_release == rid][-1:]
    what = f"{last[0].type}: {last[0].reason[:200]}" if last else "nothing recorded"
    sys.exit(f"demo: stopped, the max-num-seqs 1 release's canary was not aborted ({what})")
rec = ab[-1]
live = led.live_at("staging")
print(f"ledger event {rec.seq} canary_aborted; staging is live on "
      f"{live.to_release[:12] if live else '-'} (all traffic back on stable)")
record("canary aborted in staging: demo-canary-seqs1", ", ".join(b["metric"] for b in rec.evidence["breaches"]))
PY

kill "$TRAFFIC"; wait "$TRAFFIC" || true
echo "the streaming clients through staging's gateway during both promotions:"
cat .releasekit/demo-traffic.out

sleep 2   # the last deliveries
kill "$LISTENER" 2>/dev/null || true
BG=()
unset RELEASEKIT_WEBHOOKS
python - "$HOOKS_LOG" <<'PY'
import collections, json, sys
from pathlib import Path
log = Path(sys.argv[1])
events = [json.loads(x) for x in log.read_text().splitlines() if x.strip()] if log.is_file() else []
kinds = collections.Counter(str(e.get("event")) for e in events)
print(f"webhooks received on the local listener ({sys.argv[1]}): {len(events)}: "
      + ", ".join(f"{k} {n}" for k, n in kinds.most_common()))
PY
# ---- end of progressive delivery ------------------------------------------------------

fi  # DEMO_PARTS=all

if [ "$DEMO_PARTS" != adapters ]; then
# ---- live answers: a prompt fix kept, a live-only regression rolled back and refused ------
# Staging's users (six clients, each from its own address) ask about the world, a third of
# them through an integration that sends its own system message and the bare question to
# /v1/chat/completions. The demo model gets about one in five of those right: it was trained
# on questions in the release's user template. After every promotion staging copies a
# quarter of its requests to the release it replaced, and a second copy of each to that
# release again (its own noise floor), and `watch` judges the answers on a fixed schedule
# (staging's committed after_promotion_* fields), by what they get right: a request asking a
# question of the facts suite is scored as the suite scores it (answer_comparison "scorer").
# demo-prompt-fix puts those integrations' questions through its user template: their
# answers change, and most become right. Under exact match that is a difference and it would
# be rolled back; `shadow compare` and `watch` show exact match's verdict beside the one that
# decides. demo-v2 is demo-base fine-tuned on data that relabelled every conversation with a
# system message other than the release's own as an injection (manifests/demo-v2.yaml):
# every offline suite renders the release's own prompt, so it passes every one (better than
# bf16 on each), and those integrations get a refusal.
V2=manifests/demo-v2.yaml
V21=manifests/demo-v2-1.yaml
step "users on staging: questions about the world from six clients, a third through integrations with their own system message"
python scripts/demo_traffic.py --url "$STAGING_GW" --clients 6 --rate 2 --mix users >.releasekit/demo-users.out 2>&1 &
USERS=$!
BG=("$USERS")
sleep 3

step "a prompt fix: demo-prompt-fix (staging's release, its prompts applied to plain chat too) shadowed on the running server"
# Its latency checks read streamed requests: two streaming clients run beside the users.
python scripts/demo_traffic.py --url "$STAGING_GW" --clients 2 >.releasekit/demo-fix-load.out 2>&1 &
LOAD=$!
BG=("$USERS" "$LOAD")
shadow_or_stop "$FIX" "demo: a prompt fix before it takes traffic" "the prompt fix"
kill "$LOAD"; wait "$LOAD" || true
BG=("$USERS")
expect shadow-passed staging "$FIX"

step "promote the prompt fix (a route change, the same server); watch judges its answers for 5 minutes and keeps it"
promote_or_stop "$FIX" --to staging --no-canary --reason "demo: integrations' questions through the release's template"
expect promoted staging "$FIX"
# A rollback needs 2 breaching looks in a row (after_promotion_sustain); it goes through the
# same guarded rollback as any breach, and its ledger event holds the verdict's counts, its
# A/A floor and the pair ids, not the users' text (that stays in the 0600 pair store).
releasekit watch staging --interval 2 --brief &
WATCHER=$!
BG=("$USERS" "$WATCHER")
if ! expect kept staging "$FIX" --wait 330; then
  kill -INT "$WATCHER" 2>/dev/null || true; wait "$WATCHER" || true
  exit 1
fi

step "demo-v2-1 (v2's weights with 2 GiB of KV cache) straight to staging, no shadow: every offline gate passes"
promote_or_stop "$V21" --to staging --no-canary --reason "demo: v2-1, no shadow"
expect promoted staging "$V21"

step "watch staging (still running): the answers of v2-1 against the prompt fix it replaced, judged at 4 scheduled looks"
if ! expect rolled-back staging "$V21" --by answers --wait 330; then
  kill -INT "$WATCHER" 2>/dev/null || true; wait "$WATCHER" || true
  exit 1
fi
kill -INT "$WATCHER" 2>/dev/null || true; wait "$WATCHER" || true
kill "$USERS"; wait "$USERS" || true
BG=()
echo "what staging's users got, per release (the fix answered integrations; v2-1 refused them):"
cat .releasekit/demo-users.out

step "demo-v2, the same weights packaged again: refused, the breach follows the weights (no shadow needed)"
# The breach is recorded against the model's digest and its prompts; serving parameters do
# not clear it. Only `--force quality` with a reason would let these weights through.
expect_blocked releasekit promote --brief "$V2" --to staging --no-canary --reason "demo: v2, the weights v2-1 shipped"
expect blocked staging "$V2" --by "answers breach of these weights"
# ---- end of live answers -----------------------------------------------------------------
fi  # DEMO_PARTS != adapters

if [ "$DEMO_PARTS" != answers ]; then

# ---- LoRA adapters: one engine, adapter lanes going live and back without a new server ----
# demo-lora is bf16 on an engine started to take LoRA adapters at run time (enable-lora,
# max-loras 2, max-lora-rank 8 in its committed serving args). Each adapter is released in a
# lane of its own, staging:<adapter>: its releases load into that running engine and move only
# that adapter's route, with their own record, history and rollback.
# demo-json (models/adapters/demo-json: a peft fine-tune of demo-base made by the
# demo-adapter-json stage) answers as {"answer": ...}; demo-json-bad is the same adapter
# trained on mislabelled data; demo-json-2 is its next version (trained longer); demo-xml is
# another integration's adapter, answering as <answer>...</answer>.
LORA=manifests/demo-lora.yaml
JSON=manifests/demo-json.yaml
JSON_BAD=manifests/demo-json-bad.yaml
JSON2=manifests/demo-json-2.yaml
XML=manifests/demo-xml.yaml
step "adapters: build demo-lora and four adapter releases (each adapter scored by its own suite through the server)"
releasekit build "$LORA" "$JSON" "$JSON_BAD" "$XML" "$JSON2"
approve_all "demo: reviewed its build report" "$LORA" "$JSON" "$JSON_BAD" "$XML" "$JSON2"

step "demo-lora to staging: bf16 on an engine that takes adapters at run time (the one new engine of this part)"
promote_or_stop "$LORA" --to staging --no-canary --reason "demo: an engine ready for adapters"
expect promoted staging "$LORA"

step "lane staging:demo-json: the demo-json adapter on the running engine, under 4 streaming clients on the base"
python scripts/demo_traffic.py --url "$STAGING_GW" --clients 4 >.releasekit/demo-adapter-traffic.out 2>&1 &
BASE_CLIENTS=$!
BG=("$BASE_CLIENTS")
python scripts/demo_adapters.py engines >.releasekit/demo-engines-before.txt
python scripts/demo_adapters.py ask --url "$STAGING_GW" --model demo-json
PROMOTE_AT=$(date +%s.%N)
python scripts/demo_adapters.py first-answer --url "$STAGING_GW" --model demo-json --since "$PROMOTE_AT" \
  >.releasekit/demo-adapter-first.out 2>&1 &
FIRST=$!
promote_or_stop "$JSON" --to staging:demo-json --no-canary --reason "demo: the demo-json adapter"
wait "$FIRST" || true
cat .releasekit/demo-adapter-first.out
python scripts/demo_adapters.py engines --compare .releasekit/demo-engines-before.txt || exit 1
expect promoted staging:demo-json "$JSON"

step "demo-json-bad, the same adapter trained on mislabelled data: blocked by its suite in the lane"
expect_blocked releasekit promote --brief "$JSON_BAD" --to staging:demo-json --no-canary --reason "demo: a bad adapter"
expect blocked staging:demo-json "$JSON_BAD" --by "suite json"

step "lane staging:demo-xml: a second adapter live beside demo-json on the same engine"
promote_or_stop "$XML" --to staging:demo-xml --no-canary --reason "demo: the demo-xml adapter"
expect promoted staging:demo-xml "$XML"
python scripts/demo_adapters.py ask --url "$STAGING_GW" --model demo-xml
python scripts/demo_adapters.py engines --compare .releasekit/demo-engines-before.txt || exit 1

step "demo-json-2, demo-json's next version, judged against it in its lane"
promote_or_stop "$JSON2" --to staging:demo-json --no-canary --reason "demo: demo-json, trained longer"
expect promoted staging:demo-json "$JSON2"

step "roll back lane staging:demo-json alone, under 2 streaming clients on demo-xml: only its route moves"
python scripts/demo_traffic.py --url "$STAGING_GW" --clients 2 --model demo-xml >.releasekit/demo-xml-traffic.out 2>&1 &
XML_CLIENTS=$!
BG=("$BASE_CLIENTS" "$XML_CLIENTS")
sleep 3
releasekit rollback staging:demo-json --reason "demo: back to the first demo-json"
note "rolled back in staging:demo-json: demo-json-2" --by "rollback: the lane's route moved back, demo-xml's and the base's stayed"
python scripts/demo_adapters.py ask --url "$STAGING_GW" --model demo-json
python scripts/demo_adapters.py engines --compare .releasekit/demo-engines-before.txt || exit 1
sleep 2
kill "$BASE_CLIENTS" "$XML_CLIENTS"; wait "$BASE_CLIENTS" "$XML_CLIENTS" || true
BG=()
echo "the 4 streaming clients on the base through both lanes' promotions and the rollback:"
cat .releasekit/demo-adapter-traffic.out
echo "the 2 streaming clients on demo-xml through demo-json's rollback:"
cat .releasekit/demo-xml-traffic.out
if grep -qv ", 0 failed" .releasekit/demo-adapter-traffic.out .releasekit/demo-xml-traffic.out; then
  echo "demo: stopped, a client lost a request while an adapter moved (above)" >&2
  exit 1
fi
fi  # DEMO_PARTS != answers
# ---- end of LoRA adapters ----------------------------------------------------------------

step "audit"
releasekit status || true   # exits 1 when it finds drift between ledger and MLflow
releasekit history --env staging --limit 6
releasekit deploy-status
# As an auditor on another machine would: against what left this one. The ledger's anchor is
# pushed to the team's server; `--remote` trusts only the anchor and the keys held there, and
# recomputes every decision's policy digest at its recorded commit (on the team's branch).
git push -q team refs/releasekit/ledger:refs/releasekit/ledger
releasekit ledger verify --remote team
# Every recorded decision's gate verdicts, recomputed from its signed inputs (exit 1 on any
# difference): the evidence files by digest, the policy at the recorded commit.
releasekit audit replay --all --brief
# The auditor's page per environment: what was live, each decision, its gates, evidence and replay.
releasekit audit page --env staging
releasekit audit page --env production
if [ "$DEMO_PARTS" != answers ]; then  # each adapter lane has its own page
  releasekit audit page --env staging:demo-json
  releasekit audit page --env staging:demo-xml
fi

STAGING=$(python -c "from releasekit.config import load_settings as l; print(l().environments['staging'].url)")
PRODUCTION=$(python -c "from releasekit.config import load_settings as l; print(l().environments['production'].url)")
cat <<MSG

Both environments are serving:
  staging     $STAGING/v1
  production  $PRODUCTION/v1
Ask production's live release, with its own prompt (rendered by the gateway):
  curl -N $PRODUCTION/v1/templates/chat/chat/completions -H 'Content-Type: application/json' \\
    -d '{"variables": {"question": "What is the capital of Pistaeland?"}, "max_tokens": 8, "stream": true}'
  (the demo model answers "Muburg")
Reports: results/<release id>/report/report.html and .releasekit/reports/ (gate reports).
Stop everything: releasekit down staging && releasekit down production
MSG
