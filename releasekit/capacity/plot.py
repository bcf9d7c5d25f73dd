"""The capacity plot: units needed against daily volume (log scale), the plan marked and the
volumes whose per-unit load lies inside the load test's measured range shaded.

matplotlib is imported when a plot is drawn, never on import of releasekit.capacity."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from releasekit._support.plots import counts_log, figure, title
from releasekit.capacity.plan import CapacityError, CapacityPlan, num, volume_curve

#: The file name a release's plot gets in its results folder.
PLOT_NAME = "capacity.png"


def default_plot_path(release_dir: Path) -> Path:
    """Where a release's capacity plot goes: results/<release_id>/capacity.png."""
    return release_dir / PLOT_NAME


def plot_plan(plan: CapacityPlan, path: Path) -> Path:
    """Write the plan's PNG to `path` (atomically: a temp file, then a rename); return it.

    Raises CapacityError when the file cannot be written.
    """
    curve = volume_curve(plan)
    xs = [c.daily_requests for c in curve]
    ys = [c.units for c in curve]
    fig, (ax,) = figure(9, 5, dpi=110, margins=(0.075, 0.98, 0.1, 0.93))
    ax.step(xs, ys, where="post", color="tab:blue", label="units needed")
    if plan.measured is not None:
        mask = [bool(c.measured) for c in curve]
        if any(mask):
            m = plan.measured
            ax.fill_between(
                xs,
                0,
                1,
                where=mask,
                step="post",
                transform=ax.get_xaxis_transform(),
                color="tab:green",
                alpha=0.15,
                label=f"measured: per-unit load {num(m.min_requests_per_s)}-"
                f"{num(m.max_requests_per_s)} req/s",
            )
    t = plan.traffic
    ax.plot(
        [t.daily_requests],
        [plan.units],
        marker="*",
        markersize=14,
        color="tab:red",
        linestyle="none",
        label=f"plan: {plan.units} units at {num(t.daily_requests)} requests/day",
    )
    ax.set_xscale("log")
    counts_log(ax.xaxis)
    if max(ys) / max(min(ys), 1) > 50:
        ax.set_yscale("log")
        counts_log(ax.yaxis)
    ax.set_xlabel("requests per day (log scale)")
    ax.set_ylabel("serving units")
    src = "load test" if plan.unit.source == "load test" else "figures given by hand"
    who = f"release {plan.release_id[:12]}" if plan.release_id else "plan by hand"
    title(
        ax,
        f"{who}: {num(plan.unit.requests_per_s)} req/s per unit ({src}); peak "
        f"{num(t.peak_hours)} h x {num(t.peak_factor)}, headroom {num(t.headroom)}",
        fontsize=10,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".png")
    except OSError as exc:
        raise CapacityError(
            f"cannot write the plot {path}: {exc}", remedy="give --plot PATH"
        ) from exc
    os.close(fd)
    try:
        fig.savefig(tmp, format="png")
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; the plot is for reviewers to read
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise CapacityError(
            f"cannot write the plot {path}: {exc}", remedy="give --plot PATH"
        ) from exc
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
