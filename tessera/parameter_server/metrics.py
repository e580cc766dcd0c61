"""A run's metrics on disk: `metrics.jsonl` and a plot (staleness histogram, per-worker rates).

`metrics.jsonl` holds one JSON object a line: one `{"kind": "gradient", ...}` per log record, one
`{"kind": "worker", ...}` per worker (updates/s, wait time, dropped or not) and one
`{"kind": "staleness_histogram", "counts": {staleness: n}}`, so a run can be compared with another
without re-running it.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

from tessera.checkpoint.atomic import write_atomically
from tessera.parameter_server.result import PSResult

__all__ = ["staleness_histogram", "write_metrics"]


def staleness_histogram(result: PSResult) -> dict[int, int]:
    """Number of applied gradients per staleness value."""
    return dict(sorted(Counter(r["staleness"] for r in result.log).items()))


def write_metrics(result: PSResult, folder: str | Path, *, plot: bool = True) -> Path:
    """Write `folder/metrics.jsonl` (and `folder/metrics.png` if `plot`); the jsonl path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    lines = [{"kind": "gradient", **record} for record in result.log]
    for worker, (rate, wait) in enumerate(zip(result.updates_per_s, result.wait_s)):
        lines.append(
            {
                "kind": "worker",
                "worker": worker,
                "dropped": worker in result.dropped_workers,
                "updates_per_s": None if math.isnan(rate) else rate,
                "wait_s": None if math.isnan(wait) else wait,
            }
        )
    lines.append({"kind": "staleness_histogram", "counts": staleness_histogram(result)})
    text = "".join(json.dumps(line) + "\n" for line in lines).encode()
    # atomic: a kill while a resumed run rewrites it leaves the previous file, not half of it
    path = write_atomically(folder / "metrics.jsonl", lambda file: file.write(text))
    if plot:
        _plot(result, folder / "metrics.png")
    return path


def _plot(result: PSResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (hist, rates) = plt.subplots(1, 2, figsize=(10, 3.5))
    counts = staleness_histogram(result)
    hist.bar(list(counts), list(counts.values()))
    hist.set(title="staleness of applied gradients", xlabel="staleness", ylabel="gradients")
    workers = list(range(len(result.updates_per_s)))
    rates.bar(workers, [0 if math.isnan(r) else r for r in result.updates_per_s], label="updates/s")
    rates.bar(
        workers, [0 if math.isnan(w) else w for w in result.wait_s], alpha=0.6, label="wait s"
    )
    rates.set(title="per worker", xlabel="worker", xticks=workers)
    rates.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
