"""The eval runner: send every suite item, with the release's prompts applied, to a served
release at temperature 0, score the answers, and measure run-to-run noise.

Outcomes per item: `pass`, `fail` or `error`. A request the server rejects as invalid
(HTTP 400/413/422, e.g. an input longer than the context window) is a verdict on the
release: a pass for an item that expects rejection (`expect_error`), else a fail. A timeout,
a 5xx, a malformed response or a judge that cannot give a verdict is an `error`: no verdict,
excluded from pass rates. A server that stops accepting connections aborts the run with
ServerUnreachableError.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
import itertools
import time
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, ParamSpec

import httpx
from pydantic import BaseModel, ConfigDict, Field

from releasekit._support.files import write_atomic
from releasekit._support.http import async_http_client
from releasekit._support.progress import (
    Progress,
)
from releasekit.errors import EvalError, InputMissingError, PromptError, ServerUnreachableError
from releasekit.evaluate import scorers
from releasekit.evaluate.judge import JudgeIdentity, LLMJudge
from releasekit.evaluate.scorers import Outcome, Score
from releasekit.evaluate.suites import EvalItem, Expected, LoadedSuite, load_suite
from releasekit.serving.vllm import api_key_of
from releasekit.spec.manifest import LoadedManifest, ScorerName, Suite
from releasekit.spec.measured import MeasuredOn, measure_host
from releasekit.spec.prompts import ChatPrompt, read_template, render

_REJECTED = (400, 413, 422)


class _Evidence(BaseModel):
    """Evidence files are read with the model that writes them: an unknown key is an error."""

    model_config = ConfigDict(extra="forbid")


class ItemResult(_Evidence):
    """The record of one item in one run: what was asked, answered, and the verdict."""

    id: str
    suite: str
    scorer: ScorerName
    outcome: Outcome
    score: float | None
    output: str | None = None
    expected: Expected = None
    vars: dict[str, str] = Field(default_factory=dict)
    tags: list[str] = Field(default_factory=list)
    expect_error: bool = False
    latency_s: float | None = None
    http_status: int | None = None
    finish_reason: str | None = None
    completion_tokens: int | None = None
    error: str | None = Field(None, description="why the request failed or was rejected")
    detail: str = Field("", description="the scorer's explanation")
    judge: JudgeIdentity | None = Field(None, description="who judged (judge scorer only)")

    @property
    def passed(self) -> bool:
        """True for a pass."""
        return self.outcome == "pass"


class SuiteSummary(_Evidence):
    """Counts for one suite. `pass_rate` = passed / (passed + failed): error items have no
    verdict and are left out (None when no item got a verdict)."""

    kind: str
    scorer: str
    n: int
    passed: int
    failed: int
    errors: int
    pass_rate: float | None
    margin: float
    min_pass_rate: float | None = None
    path: str = ""
    digest: str = Field("", description="sha256 of the suite file")
    model: str = Field(
        "", description="the model name that answered: the base's served name, or the adapter"
    )
    adapter: str | None = Field(
        None, description="the adapter whose answers the suite scores (None: the base's)"
    )


class SuiteNoise(_Evidence):
    """Run-to-run noise of one suite: the same release, server and items, evaluated
    `runs` times. `flip_rate` is the mean, over pairs of runs, of the share of items
    (with a verdict in both) whose pass/fail differs; `spread` is max - min pass rate. Every
    figure is over the items all runs sent (later runs send a sample: `NOISE_ITEMS`)."""

    runs: int
    pass_rates: list[float | None]
    spread: float | None
    flip_rate: float | None
    max_flip_rate: float | None
    flipped_ids: list[str] = Field(description="items whose verdict differed in any run")
    output_change_rate: float | None = Field(
        None, description="share of items whose output text differed between any two runs"
    )
    compared: int = Field(0, description="items with a verdict in every run")


class Noise(_Evidence):
    """Run-to-run noise per suite."""

    runs: int
    suites: dict[str, SuiteNoise]


class EvalResult(_Evidence):
    """One release's eval: per-suite summaries, noise, the judge, and every item record
    (items of the first run; later runs feed only `noise`)."""

    release_id: str | None
    name: str = ""
    model: str = ""
    base_url: str = ""
    started_at: str = ""
    duration_s: float = 0.0
    suites: dict[str, SuiteSummary]
    judge: JudgeIdentity | None = None
    noise: Noise | None = None
    host: MeasuredOn | None = Field(
        None,
        description="where it was measured (host kind, cores, load); shown, not compared: "
        "quality verdicts are by the exact answers of a deterministic model",
    )
    items: list[ItemResult] = Field(default_factory=list)

    def suite_items(self, suite: str) -> list[ItemResult]:
        """The item records of one suite."""
        return [i for i in self.items if i.suite == suite]


def build_prompt(lm: LoadedManifest) -> ChatPrompt:
    """The release's ChatPrompt: system and user files with the manifest's variables bound
    (placeholders left open, such as `{{ question }}`, bind per item)."""
    p = lm.manifest.prompts
    system = None
    if p.system is not None:
        system = render(read_template(lm.resolve(p.system.file)), p.system.variables)
    user = render(read_template(lm.resolve(p.user.file)), p.user.variables)
    return ChatPrompt(system, user)


def summarise(items: Sequence[ItemResult], ls: LoadedSuite, *, model: str = "") -> SuiteSummary:
    """Count one suite's outcomes; `model` is the model name that answered."""
    passed = sum(i.outcome == "pass" for i in items)
    failed = sum(i.outcome == "fail" for i in items)
    errors = sum(i.outcome == "error" for i in items)
    s = ls.suite
    return SuiteSummary(
        kind=s.kind,
        scorer=s.scorer,
        n=len(items),
        passed=passed,
        failed=failed,
        errors=errors,
        pass_rate=passed / (passed + failed) if passed + failed else None,
        margin=s.margin,
        min_pass_rate=s.min_pass_rate,
        path=s.path.as_posix(),
        digest=ls.digest,
        model=model,
        adapter=s.adapter,
    )


NOISE_ITEMS = 256
"""Runs after the first send at most this many items of each suite (an even spread over the
suite, the same every time): run-to-run noise is a rate, and a sample estimates it without
sending a 1,440-item suite twice."""


def suite_model(suite: Suite, served_name: str) -> str:
    """The model name a suite's items are sent to: its adapter's, else the base's."""
    return suite.adapter or served_name


def noise_sample(ls: LoadedSuite, limit: int | None) -> LoadedSuite:
    """`ls` with at most `limit` of its items, evenly spread (all of them when None or
    when the suite is no larger)."""
    n = len(ls.items)
    if limit is None or n <= limit:
        return ls
    picked = [ls.items[(k * n) // limit] for k in range(limit)]
    return ls.model_copy(update={"items": picked})


def measure_noise(runs: Sequence[Sequence[ItemResult]], suites: Sequence[str]) -> Noise:
    """Compare two or more runs of the same items (see SuiteNoise); where later runs sent a
    sample of a suite, every figure is over the items all runs sent."""
    out: dict[str, SuiteNoise] = {}
    for name in suites:
        per_run = [{i.id: i for i in run if i.suite == name} for run in runs]
        ids = sorted(set.intersection(*(set(r) for r in per_run)))
        rates: list[float | None] = []
        for r in per_run:
            scored = [r[i] for i in ids if r[i].outcome != "error"]
            rates.append(sum(i.passed for i in scored) / len(scored) if scored else None)
        known = [x for x in rates if x is not None]
        verdict_ids = [i for i in ids if all(r[i].outcome != "error" for r in per_run)]
        pair_rates: list[float] = []
        flipped: set[str] = set()
        for a, b in itertools.combinations(per_run, 2):
            diff = [i for i in verdict_ids if a[i].outcome != b[i].outcome]
            flipped.update(diff)
            if verdict_ids:
                pair_rates.append(len(diff) / len(verdict_ids))
        changed = [i for i in ids if len({r[i].output for r in per_run}) > 1]
        out[name] = SuiteNoise(
            runs=len(runs),
            pass_rates=rates,
            spread=max(known) - min(known) if known else None,
            flip_rate=sum(pair_rates) / len(pair_rates) if pair_rates else None,
            max_flip_rate=max(pair_rates) if pair_rates else None,
            flipped_ids=sorted(flipped),
            output_change_rate=len(changed) / len(ids) if ids else None,
            compared=len(verdict_ids),
        )
    return Noise(runs=len(runs), suites=out)


class _Runner:
    """Sends one run's items and scores them (one instance per eval)."""

    def __init__(
        self,
        *,
        client: httpx.AsyncClient,
        judge_client: httpx.AsyncClient,
        model: str,
        prompt: ChatPrompt,
        judge: LLMJudge | None,
        concurrency: int,
        timeout_s: float,
    ) -> None:
        self.client = client
        self.judge_client = judge_client
        self.model = model
        self.prompt = prompt
        self.judge = judge
        self.sem = asyncio.Semaphore(concurrency)
        self.timeout_s = timeout_s

    async def run_suite(
        self, ls: LoadedSuite, *, label: str, progress: Progress | None
    ) -> list[ItemResult]:
        total = len(ls.items)
        done = 0
        if progress:
            progress(label, 0, total)

        model = suite_model(ls.suite, self.model)

        async def one(item: EvalItem) -> ItemResult:
            nonlocal done
            async with self.sem:
                res = await self.run_item(item, ls.suite, model=model)
            done += 1
            if progress:
                progress(label, done, total)
            return res

        return list(await asyncio.gather(*(one(i) for i in ls.items)))

    async def run_item(self, item: EvalItem, suite: Suite, *, model: str) -> ItemResult:
        scorer = item.scorer_for(suite)
        messages = self.prompt.messages(item.vars)
        rec: dict[str, Any] = {
            "id": item.id,
            "suite": suite.name,
            "scorer": scorer,
            "expected": item.expected,
            "vars": item.vars,
            "tags": item.tags,
            "expect_error": item.expect_error,
        }
        body = {
            "model": model,
            "messages": messages,
            "temperature": 0.0,
            "max_tokens": item.max_tokens or suite.max_tokens,
        }
        t0 = time.perf_counter()
        try:
            r = await self.client.post("/v1/chat/completions", json=body)
        except httpx.ConnectError as exc:
            raise ServerUnreachableError(
                f"cannot reach {self.client.base_url} during the eval: {exc}"
            ) from exc
        except httpx.TimeoutException:
            return self._error(rec, f"request timed out after {self.timeout_s:g}s")
        except httpx.HTTPError as exc:
            return self._error(rec, f"request failed: {exc!r}")
        rec["latency_s"] = round(time.perf_counter() - t0, 6)
        rec["http_status"] = r.status_code
        if r.status_code in _REJECTED:
            text = _error_text(r)
            score = scorers.rejected(r.status_code, text, expect_error=item.expect_error)
            return ItemResult(**rec, **_score_fields(score), error=text)
        if r.status_code != 200:
            return self._error(rec, f"HTTP {r.status_code}: {_error_text(r)}")
        try:
            data = r.json()
            choice = data["choices"][0]
            output = choice["message"].get("content") or ""
            rec["finish_reason"] = choice.get("finish_reason")
            rec["completion_tokens"] = (data.get("usage") or {}).get("completion_tokens")
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            return self._error(rec, f"malformed chat completion: {r.text[:200]}")
        rec["output"] = output
        if scorer == "judge":
            if self.judge is None:  # guarded in run_eval_async; kept for type narrowing
                return self._error(rec, "no judge configured")
            rec["judge"] = self.judge.identity
            score = await scorers.judge(
                item,
                output,
                input_text=messages[-1]["content"],
                llm_judge=self.judge,
                client=self.judge_client,
            )
        else:
            score = scorers.score_output(item, scorer, output)
        return ItemResult(**rec, **_score_fields(score))

    @staticmethod
    def _error(rec: dict[str, Any], text: str) -> ItemResult:
        return ItemResult(**rec, outcome="error", score=None, error=text)


def _score_fields(score: Score) -> dict[str, Any]:
    return {"outcome": score.outcome, "score": score.score, "detail": score.detail}


def _error_text(r: httpx.Response) -> str:
    try:
        data = r.json()
        msg = data.get("error", {}).get("message") if isinstance(data, dict) else None
        if not msg and isinstance(data, dict):
            msg = data.get("message") or data.get("detail")
        if msg:
            return str(msg)[:500]
    except ValueError:
        pass
    return r.text[:500]


async def _check_model(client: httpx.AsyncClient, model: str, adapters: Sequence[str] = ()) -> None:
    """Fail fast if the server is down or does not serve `model` and each of `adapters`."""
    try:
        r = await client.get("/v1/models")
    except httpx.HTTPError as exc:
        raise ServerUnreachableError(f"cannot reach {client.base_url}: {exc!r}") from exc
    if r.status_code != 200:
        raise ServerUnreachableError(
            f"{client.base_url}/v1/models answered HTTP {r.status_code}: {r.text[:200]}"
        )
    try:
        served = [m["id"] for m in r.json()["data"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise EvalError(f"{client.base_url}/v1/models answered no model list") from exc
    if model not in served:
        raise EvalError(
            f"the server at {client.base_url} does not serve model {model!r} "
            f"(it serves: {', '.join(served) or 'nothing'})",
            remedy="pass the served model name of the release (model.served_name)",
        )
    missing = [a for a in adapters if a not in served]
    if missing:
        raise EvalError(
            f"the server at {client.base_url} does not serve adapter(s) "
            f"{', '.join(repr(a) for a in missing)} that suites score "
            f"(it serves: {', '.join(served)})",
            remedy="serve the release with its adapters loaded under their names "
            "(`releasekit serve` does)",
        )


def _preflight(suites: Sequence[LoadedSuite], prompt: ChatPrompt, judge: LLMJudge | None) -> None:
    """Bind every item to the prompts (and judge prompt) before any request is sent."""
    for ls in suites:
        for item in ls.items:
            where = f"{ls.path}: item {item.id}"
            try:
                messages = prompt.messages(item.vars)
            except PromptError as exc:
                raise EvalError(f"{where}: {exc.message}") from exc
            if item.scorer_for(ls.suite) != "judge":
                continue
            if judge is None:
                raise EvalError(f"{where}: uses scorer 'judge' but the manifest has no eval.judge")
            try:
                judge.render(
                    input_text=messages[-1]["content"],
                    output="",
                    expected=None,
                    variables=item.vars,
                )
            except PromptError as exc:
                raise EvalError(f"{where}: judge prompt: {exc.message}") from exc


async def run_eval_async(
    base_url: str,
    model: str,
    lm: LoadedManifest,
    *,
    release_id: str | None = None,
    noise_runs: int = 2,
    progress: Progress | None = None,
    concurrency: int = 16,
    timeout_s: float = 120.0,
    api_key: str | None = None,
    noise_items: int | None = NOISE_ITEMS,
) -> EvalResult:
    """Evaluate a served release on its manifest's suites (`run_eval`: the same, blocking).

    Sends every item to `base_url`'s /v1/chat/completions as `model` (a suite with an
    `adapter` as that adapter's model name) at temperature 0, with
    the release's prompts applied, at most `concurrency` requests in flight; scores each
    answer; runs all suites `noise_runs` times (>= 2 measures run-to-run noise; the first
    run's items are the result; later runs send at most `noise_items` items of each suite,
    an even spread, None: all). `progress(label, done, total)` is called as items finish.

    Raises EvalError for bad suites or prompts (before any request), ServerUnreachableError
    if the server does not answer.
    """
    if noise_runs < 1:
        raise EvalError(f"noise_runs must be at least 1, got {noise_runs}")
    if concurrency < 1:
        raise EvalError(f"concurrency must be at least 1, got {concurrency}")
    started = dt.datetime.now(dt.UTC)
    host = measure_host()
    t0 = time.perf_counter()
    suites = [load_suite(lm.resolve(s.path), s) for s in lm.manifest.eval.suites]
    prompt = build_prompt(lm)
    judge = LLMJudge.from_manifest(lm)
    _preflight(suites, prompt, judge)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    # A release served with --api-key (or VLLM_API_KEY) is evaluated with that key.
    key = api_key if api_key is not None else api_key_of(lm.manifest)
    runs: list[list[ItemResult]] = []
    async with (
        async_http_client(
            base_url=base_url.rstrip("/"),
            timeout=timeout_s,
            limits=limits,
            headers={"Authorization": f"Bearer {key}"} if key else None,
        ) as client,
        async_http_client(limits=limits) as judge_client,
    ):
        adapters = list(dict.fromkeys(s.suite.adapter for s in suites if s.suite.adapter))
        await _check_model(client, model, adapters)
        runner = _Runner(
            client=client,
            judge_client=judge_client,
            model=model,
            prompt=prompt,
            judge=judge,
            concurrency=concurrency,
            timeout_s=timeout_s,
        )
        for run in range(noise_runs):
            items: list[ItemResult] = []
            for ls in suites:
                label = ls.suite.name
                if noise_runs > 1:
                    label += f" (run {run + 1}/{noise_runs})"
                sent = ls if run == 0 else noise_sample(ls, noise_items)
                items += await runner.run_suite(sent, label=label, progress=progress)
            runs.append(items)
    first = runs[0]
    names = [ls.suite.name for ls in suites]
    return EvalResult(
        release_id=release_id,
        name=lm.manifest.name,
        model=model,
        base_url=base_url,
        started_at=started.isoformat(timespec="seconds"),
        duration_s=round(time.perf_counter() - t0, 3),
        suites={
            ls.suite.name: summarise(
                [i for i in first if i.suite == ls.suite.name],
                ls,
                model=suite_model(ls.suite, model),
            )
            for ls in suites
        },
        judge=judge.identity if judge else None,
        noise=measure_noise(runs, names) if noise_runs > 1 else None,
        host=host.ended(),
        items=first,
    )


def _quiet_interrupts(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """Drop asyncio's "exception never retrieved" noise for an interrupt: the interrupt
    itself reaches the caller (and the CLI says "interrupted")."""
    if isinstance(context.get("exception"), KeyboardInterrupt | SystemExit):
        return
    loop.default_exception_handler(context)


P = ParamSpec("P")


def _blocking(
    evaluate: Callable[P, Coroutine[Any, Any, EvalResult]], *, name: str
) -> Callable[P, EvalResult]:
    """The blocking form of the coroutine function `evaluate`, called `name`: each call runs
    on an event loop of its own (an interrupt reaches the caller without asyncio's noise)."""

    @functools.wraps(evaluate)
    def blocking(*args: P.args, **kwargs: P.kwargs) -> EvalResult:
        with asyncio.Runner() as runner:
            runner.get_loop().set_exception_handler(_quiet_interrupts)
            return runner.run(evaluate(*args, **kwargs))

    blocking.__name__ = blocking.__qualname__ = name
    return blocking


run_eval = _blocking(run_eval_async, name="run_eval")


EVAL_JSON = "eval.json"
ITEMS_JSONL = "items.jsonl"


def write_outputs(result: EvalResult, out_dir: Path) -> None:
    """Write `eval.json` (summaries, judge, noise) and `items.jsonl` (one record per item)
    to `out_dir`, each atomically."""
    out_dir.mkdir(parents=True, exist_ok=True)
    items = "".join(i.model_dump_json() + "\n" for i in result.items)
    write_atomic(out_dir / ITEMS_JSONL, items.encode())
    summary = result.model_dump_json(indent=2, exclude={"items"}) + "\n"
    write_atomic(out_dir / EVAL_JSON, summary.encode())


def load_result(eval_dir: Path) -> EvalResult:
    """Read an eval folder written by `write_outputs`. InputMissingError if it holds no
    `eval.json`; EvalError if a file is unreadable."""
    summary_path = eval_dir / EVAL_JSON
    if not summary_path.is_file():
        raise InputMissingError(summary_path, what="eval result")
    items_path = eval_dir / ITEMS_JSONL
    if not items_path.is_file():
        raise InputMissingError(items_path, what="eval item records")
    return parse_result(summary_path.read_bytes(), items_path.read_bytes(), eval_dir)


def parse_result(summary: bytes, items_data: bytes, eval_dir: Path) -> EvalResult:
    """An eval result from the bytes of its `eval.json` and `items.jsonl` (as read once,
    e.g. checked against signed digests); `eval_dir` names them in errors."""
    summary_path, items_path = eval_dir / EVAL_JSON, eval_dir / ITEMS_JSONL
    try:
        result = EvalResult.model_validate_json(summary)
    except ValueError as exc:
        raise EvalError(f"unreadable eval result {summary_path}: {exc}") from exc
    items: list[ItemResult] = []
    try:
        text = items_data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise EvalError(f"{items_path}: not UTF-8 ({exc})") from exc
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            items.append(ItemResult.model_validate_json(line))
        except ValueError as exc:
            raise EvalError(f"{items_path}:{lineno}: unreadable item record: {exc}") from exc
    return result.model_copy(update={"items": items})
