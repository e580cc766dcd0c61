"""Measured pipeline timelines: events, idle share per stage, chrome-trace export.

Each stage records what it did during the last step: forward (`F`) and backward (`B`) of each
micro-batch, the weight-gradient pass (`W`), the waits for messages (`recv`) and the posting of
sends (`send`). Times are `time.perf_counter()` seconds, a system-wide monotonic clock on Linux,
so the events of the ranks of one machine line up. The idle share of a stage is
`1 - busy / span`, busy being its F, B and W time and span the whole step over all stages: the
measured counterpart of `schedule.idle_fraction` (which assumes equal stages and free transfers).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["COMPUTE", "Event", "measured_idle_fraction", "write_chrome_trace"]

COMPUTE = ("F", "B", "W")
"""Event kinds that are a stage's work; the rest (send, recv) is communication."""


@dataclass(frozen=True)
class Event:
    """One measured interval of one stage."""

    stage: int
    kind: str
    """"F", "B", "W" (the weight-gradient pass, microbatch -1: all of them), "send" or "recv"."""
    microbatch: int
    start: float
    end: float
    chunk: int = 0
    """The model chunk (interleaved schedule: virtual stage `chunk * p + stage`)."""

    @property
    def duration(self) -> float:
        """Length of the interval in seconds."""
        return self.end - self.start


def measured_idle_fraction(events: Sequence[Event]) -> list[float]:
    """Idle share of each stage over the step's span (all stages' events needed)."""
    if not events:
        return []
    span = max(e.end for e in events) - min(e.start for e in events)
    num_stages = max(e.stage for e in events) + 1
    busy = [0.0] * num_stages
    for event in events:
        if event.kind in COMPUTE:
            busy[event.stage] += event.duration
    return [1.0 - b / span if span > 0 else 0.0 for b in busy]


def write_chrome_trace(events: Sequence[Event], path: str | Path) -> Path:
    """Write `events` as a chrome-trace JSON file (open it in Perfetto or chrome://tracing).

    One track per stage (`pid` 0, `tid` = stage); times in microseconds from the step's start.
    """
    path = Path(path)
    origin = min((e.start for e in events), default=0.0)
    trace = [
        {
            "name": f"{e.kind}{e.microbatch}" + (f"c{e.chunk}" if e.chunk else "")
            if e.kind in ("F", "B")
            else e.kind,
            "cat": e.kind,
            "ph": "X",
            "pid": 0,
            "tid": e.stage,
            "ts": (e.start - origin) * 1e6,
            "dur": max(e.duration, 0.0) * 1e6,
            "args": asdict(e),
        }
        for e in events
    ]
    names = [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": s, "args": {"name": f"stage {s}"}}
        for s in sorted({e.stage for e in events})
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": names + trace, "displayTimeUnit": "ms"}))
    return path
