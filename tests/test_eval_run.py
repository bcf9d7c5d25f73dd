"""The eval runner, the judge and `releasekit eval`.

Fast tests drive a small local OpenAI-compatible server whose answers and faults (400 for
over-long input, 500, slow answers, garbage from the judge) are chosen per test: the real
vLLM cannot be made to fail on purpose. Slow tests use the real vLLM demo server.
"""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from demo_builds import USES_DEMO_BUILDS, DemoBuilds
from typer.testing import CliRunner

from releasekit.cli import app
from releasekit.errors import EvalError, ServerUnreachableError
from releasekit.evaluate import compare, load_result, run_eval, write_outputs
from releasekit.spec.manifest import LoadedManifest, load_manifest

REPO = Path(__file__).resolve().parents[1]

# A handler gets the request body and returns (status, JSON body, delay in seconds).
# The clients' timeout leaves a busy host seconds to answer the prompt items; a stalled item
# waits past it (a sleep only lasts longer on a busy host), so which items time out does
# not depend on the host's speed.
TIMEOUT_S = 3.0
STALL_S = 4.5
Handler = Callable[[dict[str, Any]], tuple[int, Any, float]]


def chat(content: str, *, finish: str = "stop") -> dict[str, Any]:
    """An OpenAI chat-completion body."""
    return {
        "id": "x",
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "finish_reason": finish,
            }
        ],
        "usage": {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13},
    }


class FakeOpenAI:
    """A local OpenAI-compatible server (threaded) that answers with `handler` and records
    every chat request it receives."""

    def __init__(self, handler: Handler, *, models: tuple[str, ...] = ("demo",)) -> None:
        self.handler = handler
        self.models = models
        self.requests: list[dict[str, Any]] = []
        fake = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _send(self, status: int, body: Any) -> None:
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (timeout tests)

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    self._send(200, {"data": [{"id": m} for m in fake.models]})
                elif self.path == "/health":
                    self._send(200, {})
                elif self.path == "/version":
                    self._send(200, {"version": "fake"})
                else:
                    self._send(404, {"error": {"message": "no such path"}})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                body["_auth"] = self.headers.get("Authorization")
                fake.requests.append(body)
                status, payload, delay = fake.handler(body)
                if delay:
                    time.sleep(delay)
                self._send(status, payload)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> FakeOpenAI:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


# ---- a small project: prompts, suites, manifest -------------------------------------------

FACTS = {"capital of A?": "Alpha", "lucky number of A?": "7", "json of A?": '{"capital": "Alpha"}'}


def question_of(body: dict[str, Any]) -> str:
    user = body["messages"][-1]["content"]
    return user.removeprefix("Q: ").strip()


def model_handler(body: dict[str, Any]) -> tuple[int, Any, float]:
    """A well-behaved fake model: facts, refusals, 400 for long input, faults on cue."""
    q = question_of(body)
    if len(q) > 300:
        return 400, {"error": {"message": "maximum context length is 512 tokens"}}, 0
    if q == "crash":
        return 500, {"error": {"message": "engine died"}}, 0
    if q == "slow":
        return 200, chat("late"), STALL_S
    if q == "garbled":
        return 200, "not json at all", 0
    return 200, chat(FACTS.get(q, "I cannot answer that.")), 0


def write_project(root: Path, *, judge_url: str | None = None) -> Path:
    """Write prompts, suites, a load profile, a dummy model and a manifest; return it."""
    (root / "prompts").mkdir(parents=True)
    (root / "prompts" / "system.txt").write_text("You are {{ persona }}. Be brief.")
    (root / "prompts" / "user.txt").write_text("Q: {{ question }}")
    (root / "prompts" / "judge.txt").write_text(
        "Rubric: {{ rubric }}\nInput: {{ input }}\nAnswer: {{ output }}\nReference: {{ expected }}"
    )
    ev = root / "eval"
    ev.mkdir()
    core = [
        {"id": "c1", "vars": {"question": "capital of A?"}, "expected": "alpha"},
        {
            "id": "c2",
            "vars": {"question": "lucky number of A?"},
            "expected": 7,
            "scorer": "numeric",
        },
        {"id": "c3", "vars": {"question": "capital of A?"}, "expected": "Beta"},
        {
            "id": "c4",
            "vars": {"question": "capital of A?"},
            "expected": "lph",
            "scorer": "contains",
        },
        {
            "id": "c5",
            "vars": {"question": "lucky number of A?"},
            "expected": r"^\d$",
            "scorer": "regex",
        },
        {
            "id": "c6",
            "vars": {"question": "json of A?"},
            "scorer": "json_schema",
            "schema": {"type": "object", "required": ["capital"]},
        },
    ]
    edge = [
        {"id": "e1", "vars": {"question": "capital of Nowhere?"}},
        {"id": "e2", "vars": {"question": "x " * 400}, "expect_error": True},
        {"id": "e3", "vars": {"question": "capital of A?"}},
        {"id": "e4", "vars": {"question": "y " * 400}},
    ]
    faults = [
        {"id": "f1", "vars": {"question": "crash"}, "expected": "x"},
        {"id": "f2", "vars": {"question": "slow"}, "expected": "x"},
        {"id": "f3", "vars": {"question": "garbled"}, "expected": "x"},
        {"id": "f4", "vars": {"question": "capital of A?"}, "expected": "Alpha"},
    ]
    for name, items in (("core", core), ("edge", edge), ("faults", faults)):
        (ev / f"{name}.jsonl").write_text("".join(json.dumps(i) + "\n" for i in items))
    suites: list[dict[str, Any]] = [
        {"name": "core", "kind": "core", "path": "eval/core.jsonl", "max_tokens": 12},
        {"name": "edge", "kind": "edge", "path": "eval/edge.jsonl", "scorer": "refusal"},
        {"name": "faults", "kind": "regression", "path": "eval/faults.jsonl"},
    ]
    manifest: dict[str, Any] = {
        "apiVersion": "releasekit/v1",
        "name": "fake",
        "model": {"source": "model", "served_name": "demo"},
        "prompts": {
            "system": {"file": "prompts/system.txt", "variables": {"persona": "Atlas"}},
            "user": {"file": "prompts/user.txt"},
        },
        "eval": {"suites": suites, "seed": 1, "bootstrap_samples": 200},
        "load": {"profile": "load.yaml"},
    }
    if judge_url is not None:
        judged = [
            {"id": "j1", "vars": {"question": "capital of A?"}, "expected": "Alpha"},
            {"id": "j2", "vars": {"question": "lucky number of A?"}},
            {"id": "j3", "vars": {"question": "json of A?"}},
            {"id": "j4", "vars": {"question": "capital of Nowhere?"}},
        ]
        (ev / "judged.jsonl").write_text("".join(json.dumps(i) + "\n" for i in judged))
        suites.append(
            {"name": "judged", "kind": "core", "path": "eval/judged.jsonl", "scorer": "judge"}
        )
        manifest["eval"]["judge"] = {
            "endpoint": judge_url,
            "model": "judge-1",
            "prompt": "prompts/judge.txt",
            "rubric": "Correct and brief.",
            "timeout_s": TIMEOUT_S,
        }
    (root / "model").mkdir()
    (root / "model" / "config.json").write_text("{}")
    shutil.copy(REPO / "pipelines" / "load" / "demo.yaml", root / "load.yaml")
    path = root / "manifest.yaml"
    path.write_text(yaml.safe_dump(manifest, sort_keys=False))
    return path


@pytest.fixture
def fake_model() -> Iterator[FakeOpenAI]:
    with FakeOpenAI(model_handler) as srv:
        yield srv


@pytest.fixture
def lm(tmp_path: Path) -> LoadedManifest:
    return load_manifest(write_project(tmp_path / "proj"), root=tmp_path / "proj")


def by_id(result: Any) -> dict[str, Any]:
    return {i.id: i for i in result.items}


# ---- the runner ---------------------------------------------------------------------------


def test_every_item_is_sent_with_the_release_prompts_at_temperature_zero(
    fake_model: FakeOpenAI, lm: LoadedManifest
) -> None:
    run_eval(fake_model.base_url, "demo", lm, noise_runs=1, timeout_s=TIMEOUT_S)
    assert len(fake_model.requests) == 14
    req = next(r for r in fake_model.requests if question_of(r) == "lucky number of A?")
    assert req["messages"] == [
        {"role": "system", "content": "You are Atlas. Be brief."},
        {"role": "user", "content": "Q: lucky number of A?"},
    ]
    assert (req["model"], req["temperature"], req["max_tokens"]) == ("demo", 0.0, 12)
    edge = next(r for r in fake_model.requests if question_of(r) == "capital of Nowhere?")
    assert edge["max_tokens"] == 32  # the suite default


def test_each_scorer_gives_its_verdict_and_the_record_keeps_the_evidence(
    fake_model: FakeOpenAI, lm: LoadedManifest
) -> None:
    result = run_eval(fake_model.base_url, "demo", lm, noise_runs=1, timeout_s=TIMEOUT_S)
    items = by_id(result)
    outcomes = {k: v.outcome for k, v in items.items() if v.suite == "core"}
    assert outcomes == {"c1": "pass", "c2": "pass", "c3": "fail", "c4": "pass", "c5": "pass",
                        "c6": "pass"}  # fmt: skip
    c3 = items["c3"]
    assert (c3.output, c3.expected, c3.http_status, c3.finish_reason) == (
        "Alpha", "Beta", 200, "stop"
    )  # fmt: skip
    assert c3.latency_s is not None and c3.latency_s > 0
    assert c3.completion_tokens == 3
    assert "expected 'Beta'" in c3.detail
    summary = result.suites["core"]
    assert (summary.n, summary.passed, summary.failed, summary.errors) == (6, 5, 1, 0)
    assert summary.pass_rate == pytest.approx(5 / 6)
    assert len(summary.digest) == 64
    assert result.noise is None


def test_rejected_over_long_input_passes_only_where_rejection_is_expected(
    fake_model: FakeOpenAI, lm: LoadedManifest
) -> None:
    items = by_id(run_eval(fake_model.base_url, "demo", lm, noise_runs=1, timeout_s=TIMEOUT_S))
    assert items["e1"].outcome == "pass"  # refused an unknown question
    assert items["e2"].outcome == "pass"  # expect_error, HTTP 400
    assert items["e2"].http_status == 400
    assert "maximum context length" in (items["e2"].error or "")
    assert items["e3"].outcome == "fail"  # answered instead of refusing
    assert items["e4"].outcome == "fail"  # 400 without expect_error
    assert "HTTP 400" in items["e4"].detail


def test_timeouts_server_errors_and_garbage_are_errors_not_fails(
    fake_model: FakeOpenAI, lm: LoadedManifest
) -> None:
    result = run_eval(fake_model.base_url, "demo", lm, noise_runs=1, timeout_s=TIMEOUT_S)
    items = by_id(result)
    assert items["f1"].outcome == "error"
    assert "HTTP 500" in (items["f1"].error or "")
    assert items["f2"].outcome == "error"
    assert "timed out" in (items["f2"].error or "")
    assert items["f3"].outcome == "error"
    assert "malformed" in (items["f3"].error or "")
    assert all(items[k].score is None for k in ("f1", "f2", "f3"))
    s = result.suites["faults"]
    assert (s.passed, s.failed, s.errors, s.pass_rate) == (1, 0, 3, 1.0)


def test_progress_reports_every_item_per_suite_and_run(
    fake_model: FakeOpenAI, lm: LoadedManifest
) -> None:
    seen: dict[str, list[tuple[int, int]]] = {}
    run_eval(
        fake_model.base_url,
        "demo",
        lm,
        noise_runs=2,
        timeout_s=TIMEOUT_S,
        progress=lambda label, done, total: seen.setdefault(label, []).append((done, total)),
    )
    assert set(seen) == {f"{s} (run {r}/2)" for s in ("core", "edge", "faults") for r in (1, 2)}
    assert seen["core (run 1/2)"][0] == (0, 6)
    assert seen["core (run 1/2)"][-1] == (6, 6)


def test_an_output_that_changes_without_changing_its_verdict_is_not_a_flip(
    tmp_path: Path,
) -> None:
    """c5 (regex ^\\d$) gets "7" in run 1 and "8" in run 2: still a pass, new text."""
    calls = {"n": 0}

    def drift(body: dict[str, Any]) -> tuple[int, Any, float]:
        if question_of(body) == "lucky number of A?":
            calls["n"] += 1  # c2 then c5 per run (concurrency 1 keeps the order)
            return 200, chat("8" if calls["n"] == 4 else "7"), 0
        return model_handler(body)

    lm = load_manifest(write_project(tmp_path / "p"), root=tmp_path / "p")
    with FakeOpenAI(drift) as srv:
        result = run_eval(
            srv.base_url, "demo", lm, noise_runs=2, timeout_s=TIMEOUT_S, concurrency=1
        )
    assert result.noise is not None
    core = result.noise.suites["core"]
    assert (core.runs, core.compared) == (2, 6)
    assert (core.flip_rate, core.max_flip_rate, core.spread, core.flipped_ids) == (
        0.0,
        0.0,
        0.0,
        [],
    )
    assert core.output_change_rate == pytest.approx(1 / 6)
    assert len(result.items) == 14  # the first run's records only
    assert by_id(result)["c5"].output == "7"


def test_noise_counts_a_verdict_that_moved_between_runs(tmp_path: Path) -> None:
    """Deterministic flip: the capital answer changes after the first run."""
    calls = {"n": 0}

    def drift(body: dict[str, Any]) -> tuple[int, Any, float]:
        if question_of(body) == "capital of A?":
            calls["n"] += 1
            return 200, chat("Alpha" if calls["n"] <= 4 else "Gamma"), 0
        return model_handler(body)

    lm = load_manifest(write_project(tmp_path / "p"), root=tmp_path / "p")
    with FakeOpenAI(drift) as srv:
        result = run_eval(
            srv.base_url, "demo", lm, noise_runs=2, timeout_s=TIMEOUT_S, concurrency=1
        )
    assert result.noise is not None
    core = result.noise.suites["core"]
    assert core.flipped_ids == ["c1", "c4"]  # c3 expected Beta: fail both times
    assert core.flip_rate == pytest.approx(2 / 6)
    assert core.pass_rates == [pytest.approx(5 / 6), pytest.approx(3 / 6)]
    assert core.spread == pytest.approx(2 / 6)


def test_later_runs_send_an_even_sample_and_noise_is_over_the_items_both_sent(
    tmp_path: Path,
) -> None:
    """With `noise_items=3`, the second run sends 3 of core's 6 items and 3 of edge's 4 (an
    even spread, the same every time); the noise figures are over the items both runs sent,
    and the result's items are the whole first run."""
    sent: list[str] = []

    def counting(body: dict[str, Any]) -> tuple[int, Any, float]:
        sent.append(question_of(body))
        if question_of(body) == "capital of A?" and sent.count("capital of A?") > 3:
            return 200, chat("Gamma"), 0  # c1, c3, c4 ask it; from run 2 on it changes
        return model_handler(body)

    lm = load_manifest(write_project(tmp_path / "p"), root=tmp_path / "p")
    with FakeOpenAI(counting) as srv:
        result = run_eval(
            srv.base_url,
            "demo",
            lm,
            noise_runs=2,
            timeout_s=TIMEOUT_S,
            concurrency=1,
            noise_items=3,
        )
    assert result.noise is not None
    core = result.noise.suites["core"]
    assert core.compared == 3  # c1, c3, c5: items 0, 2 and 4 of 6
    assert core.flipped_ids == ["c1"]
    assert core.flip_rate == pytest.approx(1 / 3)
    assert core.pass_rates == [pytest.approx(2 / 3), pytest.approx(1 / 3)]  # c1, c3, c5
    assert result.suites["edge"].n == 4 and result.noise.suites["edge"].compared == 3
    assert len(result.items) == 14  # the first run, every suite whole
    assert result.suites["core"].n == 6


@pytest.mark.parametrize(
    "suite, line, error",
    [
        (
            "edge",
            '{"id": "e9", "vars": {"question": "q"}, "expect_eror": true}',
            r"edge\.jsonl:5: expect_eror: unknown key",
        ),
        (
            "core",
            '{"id": "c9", "vars": {"qestion": "q"}, "expected": "x"}',
            r"core\.jsonl: item c9: .*question",
        ),
    ],
    ids=["bad-suite-line", "missing-prompt-variable"],
)
def test_a_bad_item_stops_the_eval_before_any_request(
    fake_model: FakeOpenAI, tmp_path: Path, suite: str, line: str, error: str
) -> None:
    path = write_project(tmp_path / "p")
    with (tmp_path / "p" / "eval" / f"{suite}.jsonl").open("a") as fh:
        fh.write(line + "\n")
    lm = load_manifest(path, root=tmp_path / "p")
    with pytest.raises(EvalError, match=error):
        run_eval(fake_model.base_url, "demo", lm, noise_runs=1)
    assert fake_model.requests == []


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_unreachable_server_is_a_server_unreachable_error(lm: LoadedManifest) -> None:
    with pytest.raises(ServerUnreachableError, match="cannot reach"):
        run_eval(f"http://127.0.0.1:{_dead_port()}", "demo", lm, noise_runs=1)


def test_a_server_not_serving_the_model_is_named(
    fake_model: FakeOpenAI, lm: LoadedManifest
) -> None:
    with pytest.raises(EvalError, match=r"does not serve model 'other' \(it serves: demo\)"):
        run_eval(fake_model.base_url, "other", lm, noise_runs=1)


def test_noise_runs_below_one_are_refused(fake_model: FakeOpenAI, lm: LoadedManifest) -> None:
    with pytest.raises(EvalError, match="noise_runs"):
        run_eval(fake_model.base_url, "demo", lm, noise_runs=0)


def test_outputs_round_trip_and_eval_json_holds_the_contracted_fields(
    fake_model: FakeOpenAI, lm: LoadedManifest, tmp_path: Path
) -> None:
    result = run_eval(fake_model.base_url, "demo", lm, release_id="r" * 64, noise_runs=2)
    out = tmp_path / "eval"
    write_outputs(result, out)
    data = json.loads((out / "eval.json").read_text())
    assert data["release_id"] == "r" * 64
    assert set(data["suites"]["core"]) >= {"kind", "scorer", "n", "passed", "failed", "errors",
                                           "pass_rate"}  # fmt: skip
    assert "items" not in data
    assert data["noise"]["suites"]["core"]["runs"] == 2
    lines = (out / "items.jsonl").read_text().splitlines()
    assert len(lines) == 14
    back = load_result(out)
    assert back == result


def test_a_corrupt_items_file_is_named_with_its_line(
    fake_model: FakeOpenAI, lm: LoadedManifest, tmp_path: Path
) -> None:
    write_outputs(run_eval(fake_model.base_url, "demo", lm, noise_runs=1), tmp_path)
    with (tmp_path / "items.jsonl").open("a") as fh:
        fh.write("{broken\n")
    with pytest.raises(EvalError, match=r"items\.jsonl:15"):
        load_result(tmp_path)


# ---- the judge ----------------------------------------------------------------------------


def judge_handler(body: dict[str, Any]) -> tuple[int, Any, float]:
    """A judge that passes Alpha, fails 7, answers garbage for JSON and hangs on refusals."""
    prompt = body["messages"][0]["content"]
    answer = prompt.split("Answer: ")[1].split("\n")[0]
    if answer == "Alpha":
        return 200, chat('{"verdict": "pass", "score": 0.9, "reason": "matches"}'), 0
    if answer == "7":
        return 200, chat("VERDICT: FAIL (no reference)"), 0
    if answer.startswith("{"):
        return 200, chat("Hmm, hard to say."), 0
    return 200, chat("PASS"), STALL_S  # past the judge's timeout


def test_the_judge_scores_with_its_identity_and_fails_closed(
    fake_model: FakeOpenAI, tmp_path: Path
) -> None:
    with FakeOpenAI(judge_handler, models=("judge-1",)) as judge:
        path = write_project(tmp_path / "p", judge_url=judge.base_url + "/v1")
        lm = load_manifest(path, root=tmp_path / "p")
        result = run_eval(fake_model.base_url, "demo", lm, noise_runs=1, timeout_s=5.0)
        assert len(judge.requests) == 4
        req = next(r for r in judge.requests if "Answer: Alpha" in r["messages"][0]["content"])
    items = by_id(result)
    assert (items["j1"].outcome, items["j1"].score) == ("pass", 0.9)
    assert items["j1"].detail == "judge: matches"
    assert items["j2"].outcome == "fail"
    assert items["j3"].outcome == "error"  # unparseable
    assert "unparseable" in items["j3"].detail
    assert items["j4"].outcome == "error"  # timed out
    assert f"timed out after {TIMEOUT_S:g}s" in items["j4"].detail
    s = result.suites["judged"]
    assert (s.passed, s.failed, s.errors) == (1, 1, 2)

    assert result.judge is not None
    ident = result.judge
    assert (ident.model, ident.temperature, ident.rubric) == ("judge-1", 0.0, "Correct and brief.")
    digest = __import__("hashlib").sha256((tmp_path / "p/prompts/judge.txt").read_bytes())
    assert ident.prompt_digest == digest.hexdigest()
    assert all(items[k].judge == ident for k in ("j1", "j2", "j3", "j4"))
    assert items["c1"].judge is None  # only judged scores carry a judge

    assert req["model"] == "judge-1"
    assert req["temperature"] == 0.0
    assert req["messages"][0]["content"] == (
        "Rubric: Correct and brief.\nInput: Q: capital of A?\nAnswer: Alpha\nReference: Alpha"
    )


def test_an_unreachable_judge_makes_error_items_not_a_crash(
    fake_model: FakeOpenAI, tmp_path: Path
) -> None:
    path = write_project(tmp_path / "p", judge_url=f"http://127.0.0.1:{_dead_port()}")
    lm = load_manifest(path, root=tmp_path / "p")
    result = run_eval(fake_model.base_url, "demo", lm, noise_runs=1)
    judged = result.suite_items("judged")
    assert {i.outcome for i in judged} == {"error"}
    assert all("judge request failed" in i.detail for i in judged)
    assert result.suites["judged"].pass_rate is None


def test_a_judge_api_key_comes_from_the_named_variable(
    fake_model: FakeOpenAI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with FakeOpenAI(judge_handler, models=("judge-1",)) as judge:
        path = write_project(tmp_path / "p", judge_url=judge.base_url)
        data = yaml.safe_load(path.read_text())
        data["eval"]["judge"]["api_key_env"] = "TEST_JUDGE_KEY"
        path.write_text(yaml.safe_dump(data))
        lm = load_manifest(path, root=tmp_path / "p")
        monkeypatch.delenv("TEST_JUDGE_KEY", raising=False)
        with pytest.raises(EvalError, match="TEST_JUDGE_KEY is not set"):
            run_eval(fake_model.base_url, "demo", lm, noise_runs=1)
        monkeypatch.setenv("TEST_JUDGE_KEY", "s3cret")
        run_eval(fake_model.base_url, "demo", lm, noise_runs=1)
        assert {r["_auth"] for r in judge.requests} == {"Bearer s3cret"}


def test_a_release_served_with_an_api_key_is_evaluated_with_it(
    fake_model: FakeOpenAI, tmp_path: Path
) -> None:
    path = write_project(tmp_path / "p")
    data = yaml.safe_load(path.read_text())
    data.setdefault("serving", {}).setdefault("args", {})["api-key"] = "rel-key"
    path.write_text(yaml.safe_dump(data))
    run_eval(fake_model.base_url, "demo", load_manifest(path, root=tmp_path / "p"), noise_runs=1)
    assert {r["_auth"] for r in fake_model.requests} == {"Bearer rel-key"}


# ---- the CLI ------------------------------------------------------------------------------


@pytest.fixture
def cli_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    import os

    for key in list(os.environ):
        if key.startswith("RELEASEKIT_"):
            monkeypatch.delenv(key)
    root = tmp_path / "proj"
    monkeypatch.setenv("RELEASEKIT_ROOT", str(root))
    monkeypatch.setenv("RELEASEKIT_CONFIG", str(root / "releasekit.toml"))
    return root


def test_cli_evaluates_a_served_release_and_reports_against_a_baseline(
    fake_model: FakeOpenAI, cli_env: Path
) -> None:
    manifest = write_project(cli_env)
    runner = CliRunner()
    base = runner.invoke(
        app, ["eval", str(manifest), "--url", fake_model.base_url, "--out", str(cli_env / "base")]
    )
    assert base.exit_code == 0, base.output
    assert "no comparison: no baseline configured" in base.output
    assert "pass rate" in base.output

    # A prompt edit makes a new release (new id) that is compared with the first.
    (cli_env / "prompts" / "user.txt").write_text("Q: {{ question }} ")
    res = runner.invoke(
        app,
        ["eval", str(manifest), "--url", fake_model.base_url, "--baseline",
         str(cli_env / "base"), "--json"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    rid = data["release_id"]
    assert data["eval_dir"] == str(cli_env / "results" / rid / "eval")
    assert data["comparison"]["baseline_name"] == "fake"
    assert "items" not in data["result"]
    report = cli_env / "results" / rid / "report"
    for name in ("compare.json", "report.md", "report.html"):
        assert (report / name).is_file()
    assert (cli_env / "results" / rid / "eval" / "items.jsonl").is_file()


def test_cli_notes_a_baseline_manifest_without_results(
    fake_model: FakeOpenAI, cli_env: Path
) -> None:
    manifest = write_project(cli_env)
    shutil.copy(manifest, cli_env / "base.yaml")
    data = yaml.safe_load(manifest.read_text())
    data["eval"]["baseline"] = "base.yaml"
    data["name"] = "cand"
    manifest.write_text(yaml.safe_dump(data))
    res = CliRunner().invoke(app, ["eval", str(manifest), "--url", fake_model.base_url])
    assert res.exit_code == 0, res.output
    assert "has no eval results yet" in res.output


def test_a_baseline_is_found_from_an_eval_folder_a_release_folder_or_a_manifest(
    tmp_path: Path,
) -> None:
    from releasekit.config import load_settings
    from releasekit.errors import InputMissingError
    from releasekit.evaluate.release import find_baseline
    from releasekit.spec.lock import compute_inputs, release_id_of

    manifest = write_project(tmp_path / "p")
    settings = load_settings(root=tmp_path / "p")
    release = tmp_path / "rel"
    (release / "eval").mkdir(parents=True)
    (release / "eval" / "eval.json").write_text("{}")
    assert find_baseline(release, settings).eval_dir == release / "eval"
    assert find_baseline(release / "eval", settings).eval_dir == release / "eval"
    rid = release_id_of(compute_inputs(load_manifest(manifest, root=tmp_path / "p")))
    found = find_baseline(manifest, settings)
    assert (found.release_id, found.eval_dir) == (rid, settings.release_dir(rid) / "eval")
    with pytest.raises(InputMissingError, match="baseline"):
        find_baseline(tmp_path / "nothing", settings)


def test_cli_reports_an_unreachable_server_in_one_line(cli_env: Path) -> None:
    manifest = write_project(cli_env)
    res = CliRunner().invoke(
        app, ["eval", str(manifest), "--url", f"http://127.0.0.1:{_dead_port()}"]
    )
    assert res.exit_code == 1
    assert "error: cannot reach" in res.output
    assert "Traceback" not in res.output


# ---- slow: the real vLLM demo server -------------------------------------------------------


@pytest.mark.slow
@USES_DEMO_BUILDS
def test_demo_core_suite_passes_with_the_good_prompt_and_drops_with_the_damaged_one(
    demo_builds: DemoBuilds,
) -> None:
    """The demo's bf16 release and its damaged prompt, evaluated by their real builds
    (`demo_builds`: vLLM serving the shipped weights, every suite run twice)."""
    assert demo_builds.build.returncode == 0, demo_builds.build.stderr[-3000:]
    project = demo_builds.project
    results = project / "results"
    g = load_result(results / demo_builds.release_id("demo-bf16") / "eval")
    b = load_result(results / demo_builds.release_id("demo-damaged-prompt") / "eval")
    bad = load_manifest(project / "manifests" / "demo-damaged-prompt.yaml", root=project)
    core = g.suites["core"]
    assert core.n >= 200
    assert core.errors == 0
    misses = [(i.id, i.output) for i in g.suite_items("core") if not i.passed][:8]
    # The floor comes from the shipped weights' own evidence (pipelines/demo/
    # shipped_weights.json): what vLLM scored them at, less the stated allowance for the
    # float kernels of another CPU kind.
    evidence = json.loads((REPO / "pipelines/demo/shipped_weights.json").read_text())
    floor = evidence["vllm_bf16"]["core"]["pass_rate"] - evidence["kernel_allowance"]
    assert core.pass_rate is not None and core.pass_rate >= floor, misses
    edge_long = [i for i in g.suite_items("edge") if i.expect_error]
    assert edge_long and all(i.http_status == 400 and i.passed for i in edge_long)
    assert g.noise is not None and g.noise.suites["core"].flip_rate is not None

    c = compare(b, g, bad)
    sc = c.suites["core"]
    assert sc.delta is not None and sc.delta < 0
    assert sc.mcnemar_p is not None and sc.mcnemar_p < 0.05
    assert sc.verdict == "inferior"
    assert c.verdict == "inferior"
    assert len(sc.flipped_to_fail) > len(sc.flipped_to_pass)


@pytest.mark.slow
def test_the_demo_model_as_judge_is_a_real_endpoint_whose_unparseable_answers_are_errors(
    vllm_server: Any, tmp_path: Path
) -> None:
    """The demo model is no judge: it answers a word or a refusal, never a verdict. Through
    the real HTTP path, every judged item must become an error, with the judge recorded."""
    path = write_project(tmp_path / "p", judge_url=vllm_server.base_url)
    data = yaml.safe_load(path.read_text())
    data["eval"]["judge"]["model"] = vllm_server.model
    data["eval"]["judge"]["timeout_s"] = 60
    data["eval"]["suites"] = [s for s in data["eval"]["suites"] if s["name"] == "judged"]
    path.write_text(yaml.safe_dump(data))
    lm = load_manifest(path, root=tmp_path / "p")
    with FakeOpenAI(model_handler) as model:
        result = run_eval(model.base_url, "demo", lm, noise_runs=1)
    judged = result.suite_items("judged")
    assert len(judged) == 4
    assert {i.outcome for i in judged} == {"error"}
    assert all("unparseable judge answer" in i.detail for i in judged)
    assert all(i.judge is not None and i.judge.model == vllm_server.model for i in judged)
