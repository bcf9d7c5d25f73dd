"""What promotion needs to know about a release: its manifest and lock, what it serves (the
target's ReleaseSpec, with the serving key that says when two releases can share a
server), its prompts for the gateway, and the environment's smoke suite."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from releasekit._support.digests import digest_obj
from releasekit.bench.runner import BENCH_JSON, BenchResult, knee_in_flight
from releasekit.config import EnvironmentConfig, Settings
from releasekit.deploy.gateway import PromptTemplate
from releasekit.deploy.target import KneeEvidence, ReleaseSpec, SmokeItem, SmokeProbe
from releasekit.errors import LockError, RegistryError, ReleasekitError
from releasekit.releases.context import release_manifest
from releasekit.releases.register import release_prompts
from releasekit.serving.vllm import api_key_of, release_model_dir
from releasekit.spec.lock import Lock, lock_path_for, read_lock, serving_args
from releasekit.spec.manifest import LoadedManifest
from releasekit.stores.ledger import EventType, Ledger
from releasekit.stores.results import ReleasePaths

CHAT_PROMPT = "chat"
"""The templated route's prompt name for a release's chat prompt:
`POST /v1/templates/chat/chat/completions` with `{"variables": {...}}`."""

_SERVING_INPUTS = ("model/", "quantisation/")
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

    @property
    def name(self) -> str:
        """The manifest name."""
        return self.lm.manifest.name

    @property
    def short_id(self) -> str:
        """The first 12 hex digits."""
        return self.lock.short_id


def serving_key(lock: Lock) -> str:
    """Digest of what a server of this release runs: model bytes, chat template,
    quantisation recipe and calibration, engine args and environment. Two releases with the
    same key (e.g. differing only in prompts) can share one vLLM server."""
    picked = {
        k: v
        for k, v in lock.inputs.items()
        if k.startswith(_SERVING_INPUTS) or k in ("chat_template", "serving")
    }
    return digest_obj(picked)


def load_release(settings: Settings, release_id: str, *, ledger: Ledger) -> ReleaseInfo:
    """The manifest and lock of `release_id`: results/<id>/lock.json and its manifest
    copy, else the registered manifest's lock file when it still has this id."""
    paths = ReleasePaths.of(settings, release_id)
    lk: Lock | None = None
    if paths.lock.is_file():
        try:
            lk = read_lock(paths.lock)
        except LockError:
            lk = None
    if lk is None or lk.release_id != release_id:
        lk = None
        regs = ledger.records(
            release=release_id, types=[EventType.REGISTER.value], newest_first=True, limit=1
        )
        manifest_rel = regs[0].evidence.get("manifest") if regs else None
        if manifest_rel:
            try:
                cand = read_lock(lock_path_for(settings.root / str(manifest_rel)))
                lk = cand if cand.release_id == release_id else None
            except LockError:
                lk = None
    manifest = release_manifest(settings, release_id, ledger=ledger)
    if lk is None or manifest is None:
        raise ReleaseContextError(
            f"release {release_id[:12]}: its "
            f"{'lock' if lk is None else 'manifest'} cannot be found (results/"
            f"{release_id[:12]}.../ or the registered manifest)"
        )
    lm = LoadedManifest(path=settings.root / lk.manifest, base=settings.root, manifest=manifest)
    return ReleaseInfo(release_id=release_id, lm=lm, lock=lk)


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
    (results/<id>/bench/bench.json made for this release, on its locked load profile), or
    None and why not, in words."""
    file = ReleasePaths.of(settings, info.release_id).bench_dir / BENCH_JSON
    if not file.is_file():
        return None, f"no load test ({file} is missing)"
    try:
        bench = BenchResult.model_validate_json(file.read_bytes())
    except (ValidationError, ValueError, OSError) as exc:
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
        ),
        "",
    )


def release_spec(settings: Settings, info: ReleaseInfo, *, ledger: Ledger) -> ReleaseSpec:
    """What a deploy target runs for `info`: its served model folder, exact engine args,
    environment, API key, the prompt templates the gateway renders and its knee (for
    autoscaling from it)."""
    m = info.lm.manifest
    knee, problem = release_knee(settings, info)
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
        knee=knee,
        knee_problem=problem or None,
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
