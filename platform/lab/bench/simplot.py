"""``retouch bench sim --plot FILE``: the simulated pool's timelines as stacked panels.

Every placement's summary (``result["configs"][name]``) carries ``timeline``: one dict per
window of simulated time with ``t_s`` (the window's start), ``arrivals`` and ``rejected``
(by arrival, in the window), ``queued``, ``ready``, ``starting`` and ``draining`` (counts at
the window's end), and ``p95_ms`` (P95 of the accepted invocations that arrived in it, or
None). :func:`plot_timelines` draws them with matplotlib's Agg backend (no display), one
line per placement in each panel, sharing the time axis.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

FORMATS = (".png", ".svg", ".pdf")
FIGSIZE_IN = (10.0, 10.0)
DPI = 100
TIMELINE_KEYS = ("t_s", "arrivals", "rejected", "queued", "ready", "starting", "draining", "p95_ms")


def check_plot_path(path: Path) -> None:
    """A ``ValueError`` now rather than after a long run: the folder must exist, the
    format must be one matplotlib writes here, and matplotlib must be installed."""
    if path.suffix.lower() not in FORMATS:
        raise ValueError(f"--plot writes {', '.join(FORMATS)} files, not {path.name!r}")
    folder = path.parent
    if not folder.is_dir():
        raise ValueError(f"cannot write the plot {path}: the folder {folder} does not exist")
    if path.is_dir():
        raise ValueError(f"cannot write the plot {path}: it is a folder")
    _pyplot()


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ValueError(
            "--plot needs matplotlib: pip install 'retouch[plot]' (make test installs it)"
        ) from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def timelines(result: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Each placement's timeline, checked: a clear ``ValueError`` when one is missing."""
    configs = result.get("configs")
    if not isinstance(configs, dict) or not configs:
        raise ValueError("the simulation result has no configs to plot")
    out = {}
    for name, summary in configs.items():
        timeline = summary.get("timeline") if isinstance(summary, dict) else None
        if not isinstance(timeline, list):
            raise ValueError(
                f"the simulation result of {name!r} has no timeline: this simulator does "
                "not record one, so there is nothing to plot"
            )
        for i, window in enumerate(timeline):
            missing = [k for k in TIMELINE_KEYS if k not in window]
            if missing:
                raise ValueError(f"{name!r} timeline window {i} lacks {', '.join(missing)}")
        out[name] = timeline
    return out


# What the title names of a result, in order, and how
TITLE_PARTS = (
    ("arrivals", "arrivals {}"),
    ("rate_rps", "{:.1f}/s"),
    ("load", "load {:g}"),
    ("executors", "{} executors"),
    ("masks", "masks {}"),
    ("profile", "profile {}"),
)


def _title(result: dict[str, Any]) -> str:
    parts = [form.format(result[key]) for key, form in TITLE_PARTS if key in result]
    return "Simulated pool: " + ", ".join(parts) if parts else "Simulated pool"


def plot_timelines(result: dict[str, Any], path: Path) -> None:
    """Stacked panels over simulated time, one line per placement: arrivals and rejected
    per second; gateway queue length; ready, starting and draining executors (steps); P95
    latency per window, with the SLO dashed when ``result`` has ``slo_ms``."""
    path = Path(path)
    series = timelines(result)
    check_plot_path(path)
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(4, 1, sharex=True, figsize=FIGSIZE_IN, dpi=DPI)
    rate_ax, queue_ax, exec_ax, p95_ax = axes
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    last = max(1, len(series) - 1)
    for i, (name, timeline) in enumerate(series.items()):
        # Policies replay the same arrivals, so lines often coincide: the first is drawn
        # widest, the later ones narrower on top of it, and every one stays visible.
        line = {"color": colours[i % len(colours)], "linewidth": 1.2 + 1.8 * (last - i) / last}
        t = [float(w["t_s"]) for w in timeline]
        width = t[1] - t[0] if len(t) > 1 and t[1] > t[0] else 10.0
        edges = [*t, t[-1] + width] if t else []  # each window's rate spans the window
        for key, style in (("arrivals", "-"), ("rejected", "--")):
            rates = [w[key] / width for w in timeline]
            rate_ax.step(edges, [*rates, *rates[-1:]], where="post", linestyle=style, **line,
                         label=name if key == "arrivals" else None)  # fmt: skip
        ends = [x + width for x in t]  # counts are taken at each window's end
        queue_ax.plot(ends, [w["queued"] for w in timeline], **line)
        for key, style in (("ready", "-"), ("starting", "--"), ("draining", ":")):
            exec_ax.step(ends, [w[key] for w in timeline], where="post", linestyle=style, **line)
        p95 = [math.nan if w["p95_ms"] is None else w["p95_ms"] / 1e3 for w in timeline]
        p95_ax.plot([x + width / 2 for x in t], p95, marker=".", label=name, **line)
    slo_ms = result.get("slo_ms")
    if slo_ms is not None:
        p95_ax.axhline(
            slo_ms / 1e3,
            color="black",
            linestyle="--",
            linewidth=1,
            label=f"SLO {slo_ms / 1e3:.2f} s",
        )
    rate_ax.set_ylabel("per second")
    rate_ax.set_title("arrivals (solid) and rejected (dashed)", fontsize=9, loc="left")
    queue_ax.set_ylabel("queued")
    queue_ax.set_title("gateway queue length", fontsize=9, loc="left")
    exec_ax.set_ylabel("executors")
    exec_ax.set_title("ready (solid), starting (dashed), draining (dotted)", fontsize=9, loc="left")
    p95_ax.set_ylabel("P95 s")
    p95_ax.set_title("P95 latency of the window's arrivals", fontsize=9, loc="left")
    p95_ax.set_xlabel("simulated time (s)")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.set_ylim(0, max(1.0, ax.get_ylim()[1]))  # an all-zero panel still reads 0..1
    for ax in (queue_ax, exec_ax):
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    rate_ax.legend(loc="upper right", fontsize=8)
    p95_ax.legend(loc="upper right", fontsize=8)
    fig.suptitle(_title(result), fontsize=10)
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as exc:
        raise ValueError(f"cannot write the plot {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
