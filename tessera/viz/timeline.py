"""Pipeline timelines: a Gantt chart per stage (PNG) or a chrome trace (JSON, for Perfetto)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tessera.pipeline.timeline import COMPUTE, Event, measured_idle_fraction, write_chrome_trace

__all__ = ["pipeline_timeline"]

_COLOURS = {"F": "#4C72B0", "B": "#DD8452", "W": "#C44E52", "recv": "#D0D0D0", "send": "#55A868"}


def pipeline_timeline(
    events: Sequence[Event], path: str | Path, *, title: str | None = None
) -> Path:
    """Draw `events` (all stages, e.g. `Pipeline.gather_timeline()`) to `path`.

    A `.json` path writes a chrome trace; anything else a Gantt chart PNG: one row per stage,
    forwards blue and backwards orange labelled by micro-batch (interleaved: `i.c` for chunk c,
    later chunks in lighter shades), the weight-gradient pass red,
    waits for messages grey, posting of sends green (thin), and each stage's measured idle share
    on the right.
    """
    path = Path(path)
    if path.suffix == ".json":
        return write_chrome_trace(events, path)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not events:
        raise ValueError("no events to draw: run a pipeline step first")
    origin = min(e.start for e in events)
    num_stages = max(e.stage for e in events) + 1
    idle = measured_idle_fraction(events)
    chunked = any(e.chunk for e in events)
    fig, ax = plt.subplots(figsize=(11, 0.7 * num_stages + 1.4))
    for e in events:
        row = num_stages - 1 - e.stage
        height = 0.8 if e.kind in COMPUTE else 0.3
        start_ms, width_ms = (e.start - origin) * 1e3, e.duration * 1e3
        ax.broken_barh(
            [(start_ms, width_ms)],
            (row - height / 2, height),
            color=_COLOURS[e.kind],
            alpha=1.0 / (1 + 0.6 * e.chunk),
            ec="white",
        )
        if e.kind in ("F", "B"):
            ax.text(
                start_ms + width_ms / 2,
                row,
                f"{e.microbatch}.{e.chunk}" if chunked else f"{e.microbatch}",
                ha="center",
                va="center",
                fontsize=7,
                color="white",
            )
    span_ms = (max(e.end for e in events) - origin) * 1e3
    ax.set_yticks(range(num_stages))
    ax.set_yticklabels([f"stage {s}" for s in reversed(range(num_stages))])
    for s in range(num_stages):
        ax.text(span_ms * 1.01, num_stages - 1 - s, f"idle {idle[s]:.0%}", va="center", fontsize=8)
    ax.set_xlim(0, span_ms * 1.1)
    ax.set_xlabel("time (ms)")
    ax.set_title(
        title
        or "pipeline timeline (blue forward, orange backward, red W pass, grey recv, green send)"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
