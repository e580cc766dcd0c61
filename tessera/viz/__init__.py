"""Plots: loss curves (more to come: bandwidth curves, pipeline timelines, memory breakdowns)."""

from tessera.viz.loss import plot_loss

__all__ = ["plot_loss"]
