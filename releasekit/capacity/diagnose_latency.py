"""The latency checks of one window, segment by segment, and the Judge that runs every check
in the order design.md's method takes them."""

from __future__ import annotations

from releasekit.capacity.diagnose_findings import Evidence, Finding, WindowChecks, make_evidence
from releasekit.capacity.diagnose_inputs import Source
from releasekit.capacity.diagnose_segments import (
    Segment,
    difference,
    grew_past_knee,
    itl_baseline,
    segment_latency,
)
from releasekit.capacity.diagnose_text import knee_note, seconds


class Judge(WindowChecks):
    """The checks of one window, in the order design.md's method takes them."""

    # -- latency segments --------------------------------------------------------------------

    def seg(self, name: str) -> Segment:
        return next(s for s in self.segments if s.name == name)

    def queueing(self) -> None:
        w, t = self.w, self.t
        q = self.seg("queue")
        waiting = w.v("waiting_requests_max")
        dominant = q.share is not None and q.share >= t.queue_share
        if not q.grew or not (dominant or (waiting or 0) > 0):
            return
        ttft_p95 = w.v("ttft_p95_s")
        slo = self.bval("slo_ttft_s")
        knee_rate = self.bval("request_rate")
        rate = w.g("request_rate") if w.g("request_rate") is not None else w.v("request_rate")
        running = w.v("running_requests")
        mns = self.bval("max_num_seqs")
        # Critical: queueing is most of the latency, TTFT breaks the profile's SLO, or more
        # requests wait than run (the engine is full over and over).
        severe = (
            (q.share or 0) >= 0.5
            or (slo is not None and (ttft_p95 or 0) > slo)
            or (running is not None and running > 0 and (waiting or 0) >= running)
        )
        ev = [
            make_evidence(
                "queue_mean_s",
                q.live_s,
                "s",
                "vllm",
                baseline=q.baseline_s,
                note=f"{q.share:.0%} of request latency" if q.share is not None else None,
            ),
            make_evidence("waiting_requests_max", waiting, "requests", "vllm"),
            make_evidence(
                "running_requests",
                running,
                "requests",
                "vllm",
                note=f"max-num-seqs {mns}" if mns is not None else None,
            ),
            make_evidence(
                "ttft_p95_s",
                ttft_p95,
                "s",
                "vllm",
                baseline=self.bval("ttft_p95_s"),
                threshold=slo,
                note="threshold: the profile's TTFT SLO" if slo is not None else None,
            ),
            make_evidence(
                "request_rate",
                rate,
                "1/s",
                "gateway" if w.g("request_rate") is not None else "vllm",
                baseline=knee_rate,
                note="baseline: the rate measured at the knee" if knee_rate else None,
            ),
        ]
        over = ""
        cause = (
            "too little capacity for the traffic: requests queue for a slot before prefill "
            "(high TTFT)"
        )
        if rate is not None and knee_rate:
            if rate > knee_rate:
                over = f"; traffic {rate:.2f} req/s over the knee's {knee_rate:.2f} req/s"
            else:
                cause = (
                    f"requests queue although traffic ({rate:.2f} req/s) is below the knee's "
                    f"{knee_rate:.2f} req/s: requests heavier than the benchmark's (longer "
                    "prompts or outputs), or fewer served at once (max-num-seqs, KV cache)"
                )
        rid = (self.release_id or "RELEASE")[:12]
        self.add(
            Finding(
                kind="queueing",
                category="performance",
                severity="critical" if severe else "warning",
                title=f"queueing: requests wait {seconds(q.live_s)} in vLLM's queue"
                f"{knee_note(q.baseline_s)}, {waiting or 0:g} waiting{over}",
                evidence=ev,
                threshold=f"queue mean {q.rule}, and queue time >= {t.queue_share:.0%} of "
                "latency or requests waiting",
                cause=cause,
                where="vllm:num_requests_waiting, vllm:request_queue_time_seconds, the request "
                "rate against the knee's",
                remedy="add serving units (size them with `releasekit capacity`), rate-limit "
                "at the gateway (rate_limit, max_in_flight), or a shorter batch window",
                commands=[
                    f"releasekit capacity {rid} --daily-requests N --peak-hours H --peak-factor F"
                ],
                added_s=difference(q.live_s, q.baseline_s) or q.live_s,
            )
        )

    def gateway_queue(self) -> None:
        w, t = self.w, self.t
        gq = w.g("gateway_queue_mean_s")
        if gq is None or gq <= t.gateway_queue_abs_s:
            return
        waiting = w.v("waiting_requests_max")
        engine_room = (waiting or 0) == 0
        self.add(
            Finding(
                kind="gateway_queue",
                category="performance",
                severity="warning",
                title=f"requests wait {seconds(gq)} for a slot at the gateway",
                evidence=[
                    make_evidence(
                        "gateway_queue_mean_s", gq, "s", "gateway", threshold=t.gateway_queue_abs_s
                    ),
                    make_evidence(
                        "gateway_queue_p95_s", w.g("gateway_queue_p95_s"), "s", "gateway"
                    ),
                    make_evidence("in_flight", w.g("in_flight"), "requests", "gateway"),
                    make_evidence("waiting_requests_max", waiting, "requests", "vllm"),
                ],
                threshold=f"gateway admission wait mean > {seconds(t.gateway_queue_abs_s)} "
                "(absolute)",
                cause="the gateway's max_in_flight is below what the engine can hold"
                if engine_room
                else "too little capacity: both the gateway and the engine queue",
                where="releasekit_gateway_queue_wait_seconds, the gateway's max_in_flight",
                remedy="raise the gateway's max_in_flight towards max-num-seqs"
                if engine_room
                else "add serving units (`releasekit capacity`) or rate-limit",
                added_s=gq,
            )
        )

    def intake(self) -> None:
        i = self.seg("intake")
        if not i.grew:
            return
        w = self.w
        self.add(
            Finding(
                kind="slow_intake",
                category="performance",
                severity="warning",
                title=f"the API server holds requests {seconds(i.live_s)} before vLLM's queue"
                f"{knee_note(i.baseline_s)}",
                evidence=[
                    make_evidence(
                        "intake_mean_s",
                        i.live_s,
                        "s",
                        "vllm",
                        baseline=i.baseline_s,
                        note="vLLM TTFT mean minus queue and prefill means",
                    ),
                    make_evidence("ttft_mean_s", w.v("ttft_mean_s"), "s", "vllm"),
                    make_evidence("queue_mean_s", w.v("queue_mean_s"), "s", "vllm"),
                    make_evidence("prefill_mean_s", w.v("prefill_mean_s"), "s", "vllm"),
                    make_evidence("running_requests", w.v("running_requests"), "requests", "vllm"),
                ],
                threshold=f"intake mean {i.rule}",
                cause="the server's front end is CPU-bound (HTTP, tokenisation, detokenising "
                "and streaming every token) and hands requests to the engine late",
                where="vllm:time_to_first_token_seconds against request_queue_time_seconds + "
                "request_prefill_time_seconds; the API server process's CPU",
                remedy="more API server processes (--api-server-count), more CPU for the front "
                "end, or fewer, larger stream chunks; add units if the engine is full too",
                added_s=difference(i.live_s, i.baseline_s) or i.live_s,
            )
        )

    def prefill(self) -> None:
        p = self.seg("prefill")
        if not p.grew:
            return
        w = self.w
        ptok = w.v("prompt_tokens_per_s")
        per_req = None
        if ptok is not None and self.requests > 0:
            per_req = ptok * w.duration_s / self.requests
        base_tok = self.bval("prompt_tokens_mean")
        longer = per_req is not None and base_tok is not None and per_req > 1.5 * base_tok
        self.add(
            Finding(
                kind="slow_prefill",
                category="performance",
                severity="warning",
                title=f"slow prefill: {seconds(p.live_s)} per request{knee_note(p.baseline_s)}",
                evidence=[
                    make_evidence("prefill_mean_s", p.live_s, "s", "vllm", baseline=p.baseline_s),
                    make_evidence(
                        "prompt_tokens_per_request",
                        per_req,
                        "tokens",
                        "vllm",
                        baseline=base_tok,
                        note="baseline: the load profile's prompt length",
                    ),
                ],
                threshold=f"prefill mean {p.rule}",
                cause="prompts longer than the benchmark's (a prompt or context change)"
                if longer
                else "prefill competes with decode in the batch, or prompts are long",
                where="vllm:request_prefill_time_seconds, vllm:prompt_tokens_total, the last "
                "prompt change",
                remedy="shorter prompts or context; enable prefix caching and chunked prefill; "
                "lower max-num-batched-tokens",
                added_s=difference(p.live_s, p.baseline_s) or p.live_s,
            )
        )

    def decode(self) -> None:
        d = self.seg("decode")
        if not d.grew:
            return
        w = self.w
        itl, base = w.v("itl_mean_s"), itl_baseline(self.b)
        running = w.v("running_requests")
        tokens = None
        if self.requests > 0 and w.v("generation_tokens_per_s") is not None:
            tokens = (w.v("generation_tokens_per_s") or 0.0) * w.duration_s / self.requests
        added = None
        if itl is not None and base is not None and tokens:
            added = (itl - base) * tokens
        rid = (self.release_id or "RELEASE")[:12]
        self.add(
            Finding(
                kind="slow_decode",
                category="performance",
                severity="warning",
                title=f"slow decode: {seconds(itl)} between tokens{knee_note(base)}, decode "
                f"{seconds(d.live_s)} per request",
                evidence=[
                    make_evidence("itl_mean_s", itl, "s", "vllm", baseline=base),
                    make_evidence(
                        "itl_p95_s", w.v("itl_p95_s"), "s", "vllm", baseline=self.bval("itl_p95_s")
                    ),
                    make_evidence("decode_mean_s", d.live_s, "s", "vllm", baseline=d.baseline_s),
                    make_evidence("running_requests", running, "requests", "vllm"),
                    make_evidence("output_tokens_per_request", tokens, "tokens", "vllm"),
                ],
                threshold=d.rule,
                cause="a batch larger than the benchmark's, weights read slower than at the "
                "benchmark (another tenant, a quantisation change), or preemptions",
                where="vllm:inter_token_latency_seconds, vllm:num_requests_running, the "
                "roofline of the release",
                remedy="lower max-num-seqs for latency, quantise the weights (less to read per "
                "step), or add units",
                commands=[f"releasekit capacity {rid} --roofline"],
                added_s=added if added is not None else difference(d.live_s, d.baseline_s),
            )
        )

    def streaming(self) -> None:
        w, t = self.w, self.t
        cpr = w.g("chunks_per_request")
        gen = w.v("generation_tokens_per_s")
        streams = self.w.count("gateway", "ttft_mean_s")
        share = streams / self.requests if self.requests > 0 else 0.0
        evidence: list[Evidence] = []
        problems: list[str] = []
        cpt = None
        if cpr is not None and gen and share >= t.stream_share_min:
            tokens_per_req = gen * w.duration_s / self.requests
            if tokens_per_req > 0:
                cpt = cpr / min(share, 1.0) / tokens_per_req
        base_cpt = self.bval("chunks_per_token")
        line = t.chunks_per_token_low
        if base_cpt is not None:
            line = min(line, base_cpt / t.factor)
        if cpt is not None and cpt < line:
            problems.append(f"{cpt:.2f} chunks per output token")
            evidence.append(
                make_evidence(
                    "chunks_per_token",
                    cpt,
                    "chunks/token",
                    "gateway",
                    baseline=base_cpt,
                    threshold=line,
                    note="gateway chunks over vLLM generation tokens (streamed requests)",
                )
            )
        g = self.seg("gateway")
        gq = w.g("gateway_queue_mean_s") or 0.0
        late = None
        if g.grew and g.live_s is not None:
            late = g.live_s - gq
            grew_beyond_queue, _ = grew_past_knee(
                late,
                g.baseline_s,
                factor=t.factor,
                floor=t.gateway_floor_s,
                absolute=t.gateway_abs_s,
            )
            if grew_beyond_queue:
                problems.append(
                    f"first token reaches the edge {seconds(g.live_s)} after the engine's"
                )
                evidence += [
                    make_evidence(
                        "edge_minus_engine_ttft_s",
                        g.live_s,
                        "s",
                        "gateway",
                        baseline=g.baseline_s,
                        note="gateway TTFT mean minus vLLM TTFT mean",
                    ),
                    make_evidence("ttft_mean_s (edge)", w.g("ttft_mean_s"), "s", "gateway"),
                    make_evidence("ttft_mean_s (engine)", w.v("ttft_mean_s"), "s", "vllm"),
                    make_evidence("gateway_queue_mean_s", gq, "s", "gateway"),
                ]
            else:
                late = None
        if not problems:
            return
        self.add(
            Finding(
                kind="streaming_stutter",
                category="performance",
                severity="warning",
                title="streaming stutters: " + "; ".join(problems),
                evidence=evidence,
                threshold=(
                    f"chunks per token < {line:.2f} (min({t.chunks_per_token_low:g}, knee / "
                    f"{t.factor:g})); first-token gap at the edge {g.rule}"
                ),
                cause="slow or buffered forwarding between the layers (engine -> gateway -> "
                "client): tokens arrive merged, in bursts",
                where="per-segment timing: vLLM TTFT vs the gateway's TTFT, "
                "releasekit_gateway_stream_chunks_total, any proxy between them",
                remedy="batch chunk forwarding (flush every few ms instead of per token, or "
                "stop a buffering proxy); check the gateway's relay and its host's CPU",
                added_s=late,
            )
        )

    def latency(self) -> None:
        """TTFT or E2E above the knee with no segment that explains it."""
        if any(
            f.kind in ("queueing", "slow_intake", "slow_prefill", "slow_decode")
            for f in self.findings
        ):
            return
        if any(f.kind in ("streaming_stutter", "gateway_queue") for f in self.findings):
            return
        w, t = self.w, self.t
        for name, slo_name in (("ttft_p95_s", "slo_ttft_s"), ("e2e_p95_s", "slo_e2e_s")):
            live = w.g(name) if w.g(name) is not None else w.v(name)
            src: Source = "gateway" if w.g(name) is not None else "vllm"
            base, slo = self.bval(name), self.bval(slo_name)
            if live is None or base is None:
                continue
            line = max(base * t.factor, slo or 0.0)
            if live <= line:
                continue
            self.add(
                Finding(
                    kind="latency",
                    category="performance",
                    severity="warning",
                    title=f"{name[:-2].replace('_', ' ')} {seconds(live)} vs {seconds(base)} "
                    "at the knee; no single segment grew",
                    evidence=[make_evidence(name, live, "s", src, baseline=base, threshold=line)]
                    + [
                        make_evidence(
                            f"{s.name}_mean_s",
                            s.live_s,
                            "s",
                            s.source or "vllm",
                            baseline=s.baseline_s,
                        )
                        for s in self.segments
                    ],
                    threshold=f"> max({t.factor:g} x knee, SLO)",
                    cause="latency spread over the segments: heavier traffic shape (longer "
                    "prompts or outputs) than the benchmark's",
                    where="the segments above; prompt and output tokens per request",
                    remedy="compare the live traffic's lengths with the load profile; rerun "
                    "the bench with a profile that matches it",
                )
            )
            return

    # -- everything --------------------------------------------------------------------------

    def run(self) -> None:
        self.stalled()
        self.memory()
        self.segments = segment_latency(self.w, self.b, self.t)
        if not self.enough:
            return
        self.errors()
        self.feedback()
        self.queueing()
        self.gateway_queue()
        self.intake()
        self.prefill()
        self.decode()
        self.streaming()
        self.latency()
