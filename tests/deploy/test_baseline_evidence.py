"""The comparison a release's report is built on reads its baseline's eval results and
bench.json only as the baseline's `register` event signed them (where it is registered):
a swapped baseline file is refused naming it. Releases are promote_kit's (real files written
by the real writers, registered in a real MLflow store and SQLite ledger)."""

from __future__ import annotations

import shutil

import pytest
from promote_kit import Kit, kit

from releasekit.evaluate.release import check_baseline_evidence
from releasekit.stores.results import ReleasePaths
from releasekit.stores.verified import EvidenceIntegrityError

__all__ = ["kit"]


def test_a_swapped_baseline_eval_or_bench_is_refused_naming_it(kit: Kit) -> None:
    base = kit.build("demo-bf16")
    bad = kit.build("demo-damaged-prompt", fail={"core": 60})
    bp, dp = ReleasePaths.of(kit.settings, base), ReleasePaths.of(kit.settings, bad)
    check_baseline_evidence(kit.settings, base, bp.eval_dir, bp.bench)  # as signed: fine

    # A copy of the registered baseline's results elsewhere is fine too: same bytes.
    elsewhere = kit.root / "copied-eval"
    shutil.copytree(bp.eval_dir, elsewhere)
    check_baseline_evidence(kit.settings, base, elsewhere)

    # The damaged release's eval results passed off as the baseline's: refused.
    bp.eval.write_text(dp.eval.read_text().replace(bad, base))
    with pytest.raises(EvidenceIntegrityError) as err:
        check_baseline_evidence(kit.settings, base, bp.eval_dir, bp.bench)
    assert f"results/{base}/eval/eval.json is not the eval/eval.json release" in err.value.message
    assert "register event #" in err.value.message and "restore the file" in err.value.remedy


def test_a_swapped_baseline_bench_is_refused_and_an_unregistered_one_is_read(kit: Kit) -> None:
    base = kit.build("demo-bf16")
    kit.variant("demo-bf16", "demo-v2", {"max-num-seqs: 32": "max-num-seqs: 16"})
    other = kit.build("demo-v2", knee_goodput=2.0, register=False)
    bp, op = ReleasePaths.of(kit.settings, base), ReleasePaths.of(kit.settings, other)
    check_baseline_evidence(kit.settings, other, op.eval_dir, op.bench)  # not registered
    bp.bench.write_text(op.bench.read_text().replace(other, base))
    with pytest.raises(EvidenceIntegrityError, match=r"bench/bench\.json is not the bench"):
        check_baseline_evidence(kit.settings, base, bp.eval_dir, bp.bench)
