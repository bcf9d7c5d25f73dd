"""The gateway in front of a real vLLM server (the session's demo-model server)."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
import webclient
from prometheus_client.parser import text_string_to_metric_families

from releasekit._support.http import http_client
from releasekit.deploy.gateway import PromptTemplate, Route, ThreadedGateway
from releasekit.serving.vllm import ServerInfo


@pytest.mark.slow
def test_streams_templates_and_feedback_through_real_vllm(
    vllm_server: ServerInfo, gateway_factory: Callable[..., ThreadedGateway]
) -> None:
    """Through the gateway, vLLM's SSE stream arrives as several chunks ending in [DONE],
    the templated route answers from the live release's template, feedback on the
    streamed response id is counted, and the edge metrics see the traffic."""
    prompts = {"qa": PromptTemplate(system="You answer briefly.", user="Q: {{ question }}\nA:")}
    route = Route(release_id="demo-bf16", base_url=vllm_server.base_url, model="demo",
                  prompts=prompts)  # fmt: skip
    tg = gateway_factory([route], api_keys=["client-key"])
    auth = {"authorization": "Bearer client-key"}
    with http_client(base_url=tg.url, headers=auth, timeout=120) as c:
        models = c.get("/v1/models")
        assert models.status_code == 200
        assert models.json()["data"][0]["id"] == "demo"
        body = {
            "model": "demo",
            "messages": [{"role": "user", "content": "Say hello"}],
            "max_tokens": 8,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            assert r.headers["x-releasekit-release"] == "demo-bf16"
            events = [ln[len("data: ") :] for ln in r.iter_lines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]" and len(events) >= 3
        response_id = json.loads(events[0])["id"]
        fb = c.post("/v1/feedback", json={"response_id": response_id, "score": "down"})
        assert fb.status_code == 200 and fb.json()["release_id"] == "demo-bf16"
        t = c.post(
            "/v1/templates/qa/chat/completions",
            json={"variables": {"question": "2+2?"}, "max_tokens": 4},
        )
        assert t.status_code == 200, t.text
        assert t.json()["choices"][0]["message"]["role"] == "assistant"
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(webclient.get(tg.url + "/metrics").text)
        for s in fam.samples
    }
    lab = (("env", "test"), ("release", "demo-bf16"))
    assert samples[("releasekit_gateway_ttft_seconds_count", lab)] == 1
    ok = (
        ("env", "test"),
        ("release", "demo-bf16"),
        ("route", "chat/completions"),
        ("status", "200"),
    )
    assert samples[("releasekit_gateway_requests_total", ok)] == 1
    neg = (*lab, ("score", "negative"))
    assert samples[("releasekit_gateway_feedback_total", neg)] == 1
