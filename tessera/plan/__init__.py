"""The planner: which strategy, and how long, for a model on a cluster (`tessera plan`).

Closed forms from the papers (`formulas`), a cluster description with presets and this machine
measured (`cluster`), a model description (`model`) and the search over strategies (`search`).
Layer 4 (DESIGN.md): it uses comm's cost model, zero's memory estimate and models; only train/ and
cli.py import it.
"""

from tessera.plan.cluster import PRESETS, Cluster, preset, this_machine
from tessera.plan.model import ModelSpec, from_module, parse_count
from tessera.plan.search import Estimate, Strategy, estimate, plan

__all__ = [
    "PRESETS",
    "Cluster",
    "Estimate",
    "ModelSpec",
    "Strategy",
    "estimate",
    "from_module",
    "parse_count",
    "plan",
    "preset",
    "this_machine",
]
