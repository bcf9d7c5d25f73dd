"""What promotion needs to know about a release: its manifest and lock, what it serves (the
target's ReleaseSpec, with the serving key that says when two releases can share a
server), its prompts for the gateway, and the environment's smoke suite."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from releasekit._support.digests import sha256_bytes, sha256_file
from releasekit.bench.runner import BENCH_JSON, BenchResult, knee_in_flight
from releasekit.config import EnvironmentConfig, Settings
from releasekit.deploy.gateway import PromptTemplate
from releasekit.deploy.target import KneeEvidence, ReleaseSpec, SmokeItem, SmokeProbe
from releasekit.errors import (
    AdapterLoadError,
    LockError,
    ManifestError,
    RegistryError,
    ReleasekitError,
)
from releasekit.releases.register import release_prompts
from releasekit.serving.adapter_store import stage_adapters
from releasekit.serving.vllm import api_key_of, release_model_dir
from releasekit.spec.lock import Lock, lock_path_for, read_lock, serving_args, serving_key
from releasekit.spec.manifest import LoadedManifest, Manifest, parse_manifest
from releasekit.stores.ledger import EventType, Ledger
from releasekit.stores.results import FILES, ReleasePaths
from releasekit.stores.verified import (
    REGISTER_REMEDY,
    SignedEvidence,
    register_record,
    verify_release_evidence,
)

CHAT_PROMPT = "chat"
"""The templated route's prompt name for a release's chat prompt:
`POST /v1/templates/chat/chat/completions` with `{"variables": {...}}`."""

_SMOKE_SCORERS = {"exact_match", "contains", "numeric", "regex", None}


class ReleaseContextError(ReleasekitError):
    """Raised when a release's manifest or lock cannot be recovered (nothing was built or
    registered for it on this machine), so it cannot be deployed or gated."""

    remedy = "build the release (`releasekit build MANIFEST`) so results/<id>/ holds its lock"


@dataclass(frozen=True)
class ReleaseInfo:
    """A release's manifest (with paths resolving against the project root) and lock."""

    release_id: str
    lm: LoadedManifest
    lock: Lock
    evidence: SignedEvidence | None = None
    """Its build outputs checked against its register event (`verify_release_evidence`)."""
    edited_manifest: str | None = None
    """Set when the project's manifest file was edited after registration (same release
    id): the gates refuse the release until it is restored or made a new release."""

    @property
    def name(self) -> str:
        """The manifest name."""
        return self.lm.manifest.name

    @property
    def short_id(self) -> str:
        """The first 12 hex digits."""
        return self.lock.short_id


def load_release(settings: Settings, release_id: str, *, ledger: Ledger) -> ReleaseInfo:
    """The manifest and lock of `release_id`, as its verified `register` event signed them:
    results/<id>/lock.json and its manifest copy (each checked against the event's digests,
    the copy also against the lock's `manifest_digest`), else the registered manifest's lock
    file when it still has this id and the manifest file the signed digest names.

    A lock or manifest copy that differs from what the event signed (or from its lock) is
    refused (ReleaseContextError naming the file); nothing is rebuilt in its place. A
    release with no register event loads (its lock and manifest copy must still agree), and
    its evidence carries the problem, which fails every evidence gate."""
    ve = verify_release_evidence(settings, release_id, ledger)
    lk = _verified_lock(settings, release_id, ve, ledger)
    manifest = _verified_manifest(settings, ve, lk) if lk is not None else None
    if lk is None or manifest is None:
        raise ReleaseContextError(
            f"release {release_id[:12]}: its "
            f"{'lock' if lk is None else 'manifest'} cannot be found (results/"
            f"{release_id[:12]}.../ or the registered manifest)"
        )
    lm = LoadedManifest(path=settings.root / lk.manifest, base=settings.root, manifest=manifest)
    return ReleaseInfo(
        release_id=release_id,
        lm=lm,
        lock=lk,
        evidence=ve,
        edited_manifest=_edited_manifest(settings, ve, lk),
    )


def _refuse(problem: str) -> ReleaseContextError:
    return ReleaseContextError(problem, remedy=REGISTER_REMEDY)


def _verified_lock(
    settings: Settings, release_id: str, ve: SignedEvidence, ledger: Ledger
) -> Lock | None:
    paths = ReleasePaths.of(settings, release_id)
    bad = ve.file_problem("lock")
    if bad is not None:
        raise _refuse(bad)
    lk: Lock | None = None
    if paths.lock.is_file():
        try:
            lk = Lock.model_validate_json(paths.lock.read_bytes())
        except (ValueError, OSError):
            lk = None
    if lk is not None and lk.release_id == release_id:
        return lk
    rec = register_record(ledger, release_id)
    manifest_rel = rec.evidence.get("manifest") if rec is not None else None
    if manifest_rel:
        try:
            cand = read_lock(lock_path_for(settings.root / str(manifest_rel)))
        except LockError:
            return None
        return cand if cand.release_id == release_id else None
    return None


def _verified_manifest(settings: Settings, ve: SignedEvidence, lk: Lock) -> Manifest | None:
    """The manifest copy as signed (and as its lock says), else the manifest file when its
    bytes are the ones signed; None when neither is there."""
    bad = ve.file_problem("manifest")
    if bad is not None:
        raise _refuse(bad)
    want = ve.manifest_digest or lk.manifest_digest
    copy = ve.directory / FILES["manifest"]
    if copy.is_file():
        data, path = copy.read_bytes(), copy
    else:
        path = settings.root / lk.manifest
        if not path.is_file():
            return None
        data = path.read_bytes()
    shown = path.relative_to(settings.root) if path.is_relative_to(settings.root) else path
    digest = sha256_bytes(data)
    if digest != want:
        what = f"release {ve.release_id[:12]}'s register event #{ve.register_seq} signed"
        raise _refuse(
            f"{shown} differs from the manifest digest "
            + (what if ve.manifest_digest else "its lock records")
        )
    if digest != lk.manifest_digest:
        raise _refuse(f"{shown} does not match its lock's manifest_digest")
    try:
        return parse_manifest(yaml.safe_load(data.decode("utf-8")), path=path)
    except (UnicodeDecodeError, yaml.YAMLError, ManifestError) as exc:
        raise _refuse(f"{shown}: unreadable manifest ({exc})") from exc


def _edited_manifest(settings: Settings, ve: SignedEvidence, lk: Lock) -> str | None:
    """Why the project's manifest file is not the one the release was registered with,
    while its lock still names this release (its gates, environments, promotion or watch
    edited after registration: same release id, other rules), or None."""
    signed = ve.manifest_digest
    path = settings.root / lk.manifest
    if signed is None or not path.is_file():
        return None
    try:
        working = read_lock(lock_path_for(path))
    except LockError:
        return None
    if working.release_id != ve.release_id or sha256_file(path) == signed:
        return None
    return (
        f"{lk.manifest} was edited after release {ve.release_id[:12]} was registered "
        f"(register event #{ve.register_seq} signed another manifest digest): its gates, "
        "environments, promotion and watch sections are part of the signed release, so the "
        "edit does not apply to it; restore the file (`git checkout -- "
        f"{lk.manifest}`), or make the change a new release (a new name or input gives a "
        "new release id) and build it"
    )


def _prompt_templates(settings: Settings, info: ReleaseInfo, ledger: Ledger) -> PromptTemplate:
    try:
        messages = release_prompts(info.lm, info.lock)
    except ReleasekitError:
        messages = []
    if not messages:
        from releasekit.stores import mlflow as registry

        regs = ledger.records(
            release=info.release_id, types=[EventType.REGISTER.value], newest_first=True, limit=1
        )
        uri = regs[0].evidence.get("prompt_uri") if regs else None
        if uri:
            try:
                messages = registry.prompt_messages(settings, str(uri))
            except RegistryError:
                messages = []
    by_role = {m["role"]: m["content"] for m in messages}
    if "user" not in by_role:
        raise ReleaseContextError(
            f"release {info.short_id}: its prompts cannot be recovered with the locked "
            "digests (the prompt files changed and MLflow has no copy)",
            remedy="restore the prompt files, or register the release so MLflow keeps them",
        )
    return PromptTemplate(system=by_role.get("system"), user=by_role["user"])


def release_knee(settings: Settings, info: ReleaseInfo) -> tuple[KneeEvidence | None, str]:
    """The release's knee from its own load test, verified as the evidence gate verifies it
    (results/<id>/bench/bench.json as its register event signed it, made for this release,
    on its locked load profile), or None and why not, in words. The knee carries the core
    count it was measured on (None: not recorded)."""
    file = ReleasePaths.of(settings, info.release_id).bench_dir / BENCH_JSON
    if not file.is_file():
        return None, f"no load test ({file} is missing)"
    if info.evidence is None:
        return None, f"{file} was not checked against the release's register event"
    try:
        data = info.evidence.read_bytes("bench")
    except ReleasekitError as exc:
        return None, exc.message
    try:
        bench = BenchResult.model_validate_json(data)
    except (ValidationError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return None, f"unreadable load test {file}: {first}"
    if bench.release_id != info.release_id:
        return None, f"{file} is for release {str(bench.release_id)[:12]}, not this one"
    if bench.profile_digest != info.lock.inputs.get("load/profile"):
        return None, f"{file} was made with another load profile than the locked one"
    in_flight = knee_in_flight(bench)
    if in_flight is None or bench.knee is None:
        why = bench.knee_stop or "no load point met its SLOs"
        return None, f"its load test has no knee ({why})"
    return (
        KneeEvidence(
            in_flight=in_flight,
            load=bench.knee.load,
            mode=bench.mode,
            source=str(
                file.relative_to(settings.root) if file.is_relative_to(settings.root) else file
            ),
            cores=bench.host.cores if bench.host is not None else None,
            host=bench.host.label if bench.host is not None else None,
        ),
        "",
    )


def release_spec(settings: Settings, info: ReleaseInfo, *, ledger: Ledger) -> ReleaseSpec:
    """What a deploy target runs for `info`: its served model folder, exact engine args,
    environment, API key, the prompt templates the gateway renders, its knee (for
    autoscaling from it) and its adapters, staged as verified copies under
    `state_dir/adapters`. Adapters whose files differ from the lock's leave the spec's
    `adapters_problem` set (a deploy of it then fails, recorded, before anything starts)."""
    m = info.lm.manifest
    knee, problem = release_knee(settings, info)
    adapters_problem: str | None = None
    try:
        staged = stage_adapters(
            settings.state_dir / "adapters", m.adapters, info.lock.inputs, info.lm.resolve
        )
    except AdapterLoadError as exc:
        staged, adapters_problem = [], exc.message
    return ReleaseSpec(
        release_id=info.release_id,
        name=m.name,
        serving_key=serving_key(info.lock),
        model_dir=str(release_model_dir(settings, info.lm, info.lock)),
        served_name=m.served_name,
        engine_args=serving_args(m),
        env=dict(m.serving.env),
        api_key=api_key_of(m),
        prompts={CHAT_PROMPT: _prompt_templates(settings, info, ledger)},
        # From the signed lock, not the manifest file: the lock pins `prompts.plain_chat`.
        plain_chat_prompt=CHAT_PROMPT if "prompt/plain_chat" in info.lock.inputs else None,
        knee=knee,
        knee_problem=problem or None,
        adapters={a.name: a.engine_name for a in staged},
        adapter_dirs={a.engine_name: str(a.path) for a in staged},
        adapters_problem=adapters_problem,
    )


def _expected(item: dict[str, Any], suite_scorer: str | None) -> str | None:
    scorer = item.get("scorer", suite_scorer)
    exp = item.get("expected")
    if scorer not in _SMOKE_SCORERS or item.get("expect_error"):
        return None
    if isinstance(exp, str | int | float) and not isinstance(exp, bool):
        return str(exp)
    return None


def smoke_probe(cfg: EnvironmentConfig, info: ReleaseInfo) -> SmokeProbe:
    """The environment's smoke suite for this release: `smoke.path`, else the manifest's
    suite `smoke.suite`, its first `max_items` items."""
    sc = cfg.smoke
    suite_scorer: str | None = None
    path: Path | None = None
    if sc.path is not None:
        path = sc.path if sc.path.is_absolute() else info.lm.base / sc.path
    elif sc.suite is not None:
        for s in info.lm.manifest.eval.suites:
            if s.name == sc.suite:
                path, suite_scorer = info.lm.resolve(s.path), s.scorer
        if path is None:
            raise ReleaseContextError(
                f"the smoke suite {sc.suite!r} is not a suite of {info.name}",
                remedy="set environments.<env>.smoke.suite to a manifest suite, or smoke.path",
            )
    if path is None or not path.is_file():
        raise ReleaseContextError(
            f"smoke suite file not found: {path}", remedy="fix environments.<env>.smoke"
        )
    items: list[SmokeItem] = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as exc:
            raise ReleaseContextError(f"{path}:{lineno}: not JSON: {exc}") from exc
        if not isinstance(rec, dict) or rec.get("expect_error"):
            continue
        items.append(
            SmokeItem(
                id=str(rec.get("id", f"line-{lineno}")),
                vars={str(k): str(v) for k, v in (rec.get("vars") or {}).items()},
                expected=_expected(rec, suite_scorer),
            )
        )
        if len(items) >= sc.max_items:
            break
    return SmokeProbe(
        name=path.name,
        prompt=CHAT_PROMPT,
        items=items,
        max_tokens=sc.max_tokens,
        min_pass_rate=sc.min_pass_rate,
        timeout_s=sc.timeout_s,
    )
