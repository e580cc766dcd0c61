"""Plots: loss curves, pipeline timelines (Gantt PNG or chrome trace)."""

from tessera.viz.loss import plot_loss
from tessera.viz.timeline import pipeline_timeline

__all__ = ["pipeline_timeline", "plot_loss"]
