"""The served weights in the signed record: the register event carries quantise.json's
weights digest and the host kind that quantised them (read from the very bytes whose digest
it signs), `show` prints them, a quantise.json edited afterwards fails verification, events
written before they were signed still verify, and a perf comparison of weights made on
another host kind than their load test's fails as evidence naming the maker."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import pytest
from typer.testing import CliRunner

from releasekit.bench.result import BenchResult
from releasekit.cli import app
from releasekit.errors import RegistryError
from releasekit.promote.context import load_release
from releasekit.promote.evidence_gates import Evidence, _host_gate
from releasekit.releases.queries import show
from releasekit.releases.register import register_release, signed_weights
from releasekit.spec.measured import MeasuredOn
from releasekit.stores.evidence import read_evidence
from releasekit.stores.ledger import Event, EventType, Ledger
from releasekit.stores.verified import verify_release_evidence

if TYPE_CHECKING:
    from releasekit.spec.lock import Lock
    from tests.releases.conftest import Proj

runner = CliRunner()

AMD = {"cpu_vendor": "AuthenticAMD", "cpu_model": "AMD EPYC 9B14", "isa": "avx512_bf16"}
PINS = {"threads": 1, "mkl": "AVX2,STRICT", "aten": "avx2", "onednn": "AVX2"}


def _quantise_json(p: Proj, lk: Lock, **fields: Any) -> dict[str, Any]:
    """Rewrite the release's quantise.json with `fields` (a digest of its own, a maker)."""
    path = p.settings.release_dir(lk.release_id) / "quantise.json"
    data = json.loads(path.read_text())
    data.update(fields)
    path.write_text(json.dumps(data))
    return data


def _register(p: Proj, lk: Lock, name: str) -> Any:
    register_release(p.settings, p.manifest(name))
    led = Ledger(p.settings.ledger_url or "")
    (rec,) = led.records(release=lk.release_id, types=[EventType.REGISTER.value])
    return rec


def test_the_register_event_signs_the_weights_digest_and_maker(mlproj: Proj) -> None:
    lk = mlproj.build("demo-w4a16")
    q = _quantise_json(
        mlproj, lk, weights_digest="c3" * 32, made_on={**AMD, "cores": 2}, float_paths=PINS
    )
    rec = _register(mlproj, lk, "demo-w4a16")
    assert rec.evidence["weights_digest"] == q["weights_digest"] == "c3" * 32
    assert rec.evidence["weights_made_on"] == AMD  # the kind, not the cores
    ve = verify_release_evidence(
        mlproj.settings, lk.release_id, Ledger(mlproj.settings.ledger_url or "")
    )
    assert ve.ok and ve.weights_digest == "c3" * 32
    assert ve.weights_made_on is not None and ve.weights_made_on.isa == "avx512_bf16"


def test_unquantised_or_unrecorded_weights_have_no_maker(mlproj: Proj) -> None:
    """scheme none: the source model's digest, no maker even if quantise.json names a host;
    a quantise.json from before the maker was recorded: the digest, maker null."""
    bf16 = mlproj.build("demo-bf16")
    _quantise_json(mlproj, bf16, scheme="none", made_on=AMD)
    rec = _register(mlproj, bf16, "demo-bf16")
    assert rec.evidence["weights_digest"] == "ab" * 32 and rec.evidence["weights_made_on"] is None

    w4 = mlproj.build("demo-w4a16")
    rec = _register(mlproj, w4, "demo-w4a16")
    assert rec.evidence["weights_digest"] == "ab" * 32 and rec.evidence["weights_made_on"] is None
    d = show(mlproj.settings, w4.release_id)
    assert d.weights and d.weights.made_on is None and d.weights.scheme == "W4A16"


def test_weights_are_taken_only_from_the_bytes_whose_digest_is_signed(mlproj: Proj) -> None:
    """quantise.json rewritten between its digest and its read: nothing is signed."""
    lk = mlproj.build("demo-w4a16")
    ev = read_evidence(mlproj.settings, lk.release_id)
    assert signed_weights(ev)["weights_digest"] == "ab" * 32
    _quantise_json(mlproj, lk, weights_digest="ee" * 32)
    with pytest.raises(RegistryError, match=r"quantise\.json changed while it was being"):
        signed_weights(ev)


def test_show_prints_the_signed_digest_and_maker(mlproj: Proj) -> None:
    lk = mlproj.build("demo-w4a16")
    _quantise_json(mlproj, lk, weights_digest="c3" * 32, made_on=AMD)
    rec = _register(mlproj, lk, "demo-w4a16")
    d = show(mlproj.settings, lk.release_id)
    assert d.weights and d.weights.digest == "c3" * 32 and d.weights.signed_seq == rec.seq
    res = runner.invoke(app, ["show", lk.release_id[:10]])
    assert res.exit_code == 0, res.output
    out = res.stdout
    assert "c3" * 6 in out and "c3" * 7 not in out  # the short form only
    assert "AMD EPYC 9B14 (avx512_bf16)" in out and f"register event #{rec.seq}" in out
    res = runner.invoke(app, ["show", "--json", lk.release_id[:10]])
    w = json.loads(res.stdout)["weights"]
    assert w["digest"] == "c3" * 32 and w["made_on"]["isa"] == "avx512_bf16"


def test_a_quantise_json_edited_after_registration_fails_verification(mlproj: Proj) -> None:
    """A new digest written into quantise.json: the file is named as not as signed, and
    show keeps the digest the register event signed, with a note."""
    lk = mlproj.build("demo-w4a16")
    _quantise_json(mlproj, lk, made_on=AMD)
    _register(mlproj, lk, "demo-w4a16")
    _quantise_json(mlproj, lk, weights_digest="ff" * 32)
    ve = verify_release_evidence(
        mlproj.settings, lk.release_id, Ledger(mlproj.settings.ledger_url or "")
    )
    assert not ve.ok
    (prob,) = ve.problems
    assert "quantise.json differs from the digest" in prob
    d = show(mlproj.settings, lk.release_id)
    assert d.weights and d.weights.digest == "ab" * 32
    assert any("weights not read from quantise.json" in n for n in d.notes)


def test_a_register_event_without_weights_still_verifies_and_shows(mlproj: Proj) -> None:
    """An event written before the weights were signed: the ledger verifies, the evidence
    checks, and show falls back to quantise.json's digest, marked unsigned."""
    lk = mlproj.build("demo-w4a16")
    ev = read_evidence(mlproj.settings, lk.release_id)
    led = Ledger(mlproj.settings.ledger_url or "")
    led.append(
        Event(
            type=EventType.REGISTER,
            to_release=lk.release_id,
            reason="registered demo-w4a16 version 1",
            evidence={
                "model_name": "demo-w4a16",
                "model_version": "1",
                "reports": ev.digests,
                "manifest_digest": lk.manifest_digest,
            },
        )
    )
    led.verified()
    ve = verify_release_evidence(mlproj.settings, lk.release_id, led)
    assert ve.ok and ve.weights_digest is None and ve.weights_made_on is None
    d = show(mlproj.settings, lk.release_id)
    assert d.weights and d.weights.digest == "ab" * 32 and d.weights.signed_seq is None
    res = runner.invoke(app, ["show", lk.release_id[:10]])
    assert res.exit_code == 0 and "not recorded" in res.stdout


def _evidence(p: Proj, lk: Lock, host: MeasuredOn) -> Evidence:
    info = load_release(p.settings, lk.release_id, ledger=Ledger(p.settings.ledger_url or ""))
    return Evidence(info=info, bench=BenchResult.model_construct(host=host))


def test_weights_made_on_another_host_kind_fail_the_host_gate_naming_the_maker(
    mlproj: Proj,
) -> None:
    """Both load tests ran on one host kind, but the candidate's weights were quantised on
    another: no silent pass; the host gate fails and names where the weights were made.
    Weights made where they were measured compare as before; where the load tests' hosts
    differ, the detail also names each release's weights' maker."""
    here = MeasuredOn(**AMD, cores=2)
    intel = {"cpu_vendor": "GenuineIntel", "cpu_model": "Xeon (test)", "isa": "avx2"}
    mlproj.variant("demo-w4a16", "demo-w4b", {"max-num-seqs: 32": "max-num-seqs: 16"})
    live = mlproj.build("demo-w4a16")
    _quantise_json(mlproj, live, made_on={**AMD, "gpus": []})  # quantised on the CPU
    cand = mlproj.build("demo-w4b")
    _quantise_json(mlproj, cand, made_on=intel)
    _register(mlproj, live, "demo-w4a16")
    _register(mlproj, cand, "demo-w4b")

    g = _host_gate(_evidence(mlproj, cand, here), _evidence(mlproj, live, here))
    assert g is not None and not g.passed and g.kind == "evidence"
    assert "the candidate's weights were quantised on another host kind" in g.detail
    assert "CPU vendor, CPU model, instruction-set level differ" in g.detail
    assert "weights quantised on candidate: Xeon (test) (avx2)" in g.detail
    assert "live: AMD EPYC 9B14 (avx512_bf16)" in g.detail

    assert _host_gate(_evidence(mlproj, live, here), _evidence(mlproj, live, here)) is None
    # Weights quantised on the CPU of a host that is benched with a GPU: one kind.
    gpu = MeasuredOn(**AMD, gpus=["NVIDIA H100"], cores=2)
    assert _host_gate(_evidence(mlproj, live, gpu), _evidence(mlproj, live, gpu)) is None

    there = MeasuredOn(**intel, cores=2)
    g = _host_gate(_evidence(mlproj, live, there), _evidence(mlproj, live, here))
    assert g is not None and "benched on another host (another host kind" in g.detail
    assert "weights quantised on candidate: AMD EPYC 9B14 (avx512_bf16)" in g.detail
