"""The loss curve of a run, as a PNG."""

from __future__ import annotations

from pathlib import Path

__all__ = ["plot_loss"]


def plot_loss(records: list[dict], path: str | Path, *, title: str = "training loss") -> Path:
    """Draw loss against step from metrics records and save it to `path`.

    Lines without a loss (the events of metrics.jsonl, such as restarts) are left out.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for r in records if "loss" in r and "event" not in r]
    steps = [r["step"] for r in records]
    losses = [r["loss"] for r in records]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    ax.plot(steps, losses, lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per character)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path
