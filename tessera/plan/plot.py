"""`tessera plan --plot`: a stacked memory bar and a stacked time bar per strategy (PNG)."""

from __future__ import annotations

from pathlib import Path

from tessera.plan.search import Estimate

__all__ = ["plot_estimates"]

_MEMORY = (("params", "params"), ("grads", "grads"), ("optimizer", "optimizer"),
           ("activations", "activations"))  # fmt: skip
_TIME = (("compute_s", "compute"), ("comm_s", "exposed comm"), ("bubble_s", "bubble"),
         ("offload_s", "offload"))  # fmt: skip


def plot_estimates(
    estimates: list[Estimate],
    path: str | Path,
    *,
    title: str = "tessera plan",
    memory_limit: float | None = None,
) -> Path:
    """Two horizontal stacked bars per strategy: memory per device (GB) and step time (s)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [e.strategy.name + ("" if e.fits else " (does not fit)") for e in estimates]
    rows = range(len(estimates))
    fig, (mem_ax, time_ax) = plt.subplots(
        1, 2, figsize=(13, 1.0 + 0.35 * len(estimates)), sharey=True
    )
    for ax, parts, scale in ((mem_ax, _MEMORY, 1e9), (time_ax, _TIME, 1.0)):
        left = [0.0] * len(estimates)
        for attr, label in parts:
            values = [getattr(e, attr) / scale for e in estimates]
            ax.barh(rows, values, left=left, label=label)
            left = [a + b for a, b in zip(left, values)]
        ax.legend(loc="lower right", fontsize="small")
    if memory_limit:
        mem_ax.axvline(memory_limit / 1e9, color="black", linestyle="--", linewidth=1)
    mem_ax.set_xlabel("memory per device (GB)")
    time_ax.set_xlabel("step time (s)")
    mem_ax.set_yticks(list(rows), names, fontsize="small")
    mem_ax.invert_yaxis()
    fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
