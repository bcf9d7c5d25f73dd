"""The `results/<release id>/` folder: the one object that knows every path in it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from releasekit.config import Settings

FILES: dict[str, str] = {
    "lock": "lock.json",
    "manifest": "manifest.yaml",
    "quantise": "quantise.json",
    "bench": "bench/bench.json",
    "bench_plot": "bench/bench.png",
    "eval": "eval/eval.json",
    "eval_items": "eval/items.jsonl",
    "compare": "report/compare.json",
    "report_md": "report/report.md",
    "report_html": "report/report.html",
}
"""The evidence files of a release, by key, relative to its folder."""


@dataclass(frozen=True)
class ReleasePaths:
    """Every path in one release's results folder (`ReleasePaths.of(settings, release_id)`)."""

    root: Path

    @classmethod
    def of(cls, settings: Settings, release_id: str) -> ReleasePaths:
        """The paths of `release_id`'s folder under the settings' results directory."""
        return cls(settings.release_dir(release_id))

    def file(self, key: str) -> Path:
        """The path of an evidence file by its FILES key."""
        return self.root / FILES[key]

    @property
    def lock(self) -> Path:
        """Copy of the release's lock (written by the quantise stage)."""
        return self.root / FILES["lock"]

    @property
    def manifest(self) -> Path:
        """Copy of the manifest the release was built from."""
        return self.root / FILES["manifest"]

    @property
    def quantise(self) -> Path:
        """quantise.json: what quantisation did."""
        return self.root / FILES["quantise"]

    @property
    def model(self) -> Path:
        """The quantised model folder (absent for `scheme: none`)."""
        return self.root / "model"

    @property
    def bench_dir(self) -> Path:
        """The load test's folder (bench.json, bench.png, requests.jsonl)."""
        return self.root / "bench"

    @property
    def bench(self) -> Path:
        """bench.json: the load sweep and its knee."""
        return self.root / FILES["bench"]

    @property
    def eval_dir(self) -> Path:
        """The evaluation's folder (eval.json, items.jsonl, server.log)."""
        return self.root / "eval"

    @property
    def eval(self) -> Path:
        """eval.json: per-suite results."""
        return self.root / FILES["eval"]

    @property
    def report_dir(self) -> Path:
        """The comparison report's folder (compare.json, report.md, report.html)."""
        return self.root / "report"

    @property
    def compare(self) -> Path:
        """compare.json: the paired comparison with the baseline."""
        return self.root / FILES["compare"]
