"""The loss curve of a run, as a PNG."""

from __future__ import annotations

from pathlib import Path

__all__ = ["plot_loss"]


def plot_loss(records: list[dict], path: str | Path, *, title: str = "training loss") -> Path:
    """Draw loss (and val_loss, where evaluated) against step from metrics records; save it.

    Lines without a loss (the events of metrics.jsonl, such as restarts) are left out.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for r in records if "loss" in r and "event" not in r]
    steps = [r["step"] for r in records]
    losses = [r["loss"] for r in records]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    ax.plot(steps, losses, lw=1.2, label="training loss")
    held_out = [r for r in records if "val_loss" in r]
    if held_out:  # evaluations (--eval-every): the held-out loss at each
        ax.plot(
            [r["step"] for r in held_out],
            [r["val_loss"] for r in held_out],
            "o-",
            lw=1.2,
            ms=3,
            label="val_loss (held out)",
        )
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per character)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path
