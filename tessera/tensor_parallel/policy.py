"""`TensorPolicy`: the knobs of tensor-parallel training, one default each."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["TensorPolicy"]


@dataclass(kw_only=True, frozen=True)
class TensorPolicy:
    """How `strategy="tensor"` splits the model over the ranks."""

    plan: Mapping[str, str] | None = field(
        default=None,
        metadata={
            "knob": "tp_plan",
            "help": "tensor, hybrid with --model: JSON/YAML file {module-name pattern: "
            "column|row|embedding}.",
            "config_type": str | None,
        },
    )
    """`{module-name pattern (fnmatch): style}`, styles "column", "row", "embedding", "vocab",
    "column_gather" (see `tessera.tensor_parallel.parallelize`). None: the model's own plan
    (tessera's GPT; Hugging Face GPT-2 and BERT, `plans.py`); any other model must be given one.
    Checked against the model when the engine is built."""

    def __post_init__(self) -> None:
        if self.plan is None:
            return
        from tessera.tensor_parallel.parallelize import STYLES  # (a plan given: the layers load)

        if not isinstance(self.plan, Mapping):
            raise ValueError(f"plan must be a mapping of pattern -> style, got {self.plan!r}")
        if not self.plan:
            raise ValueError("plan is empty: name the modules to split (or plan=None)")
        for pattern, style in self.plan.items():
            if not isinstance(pattern, str) or style not in STYLES:
                raise ValueError(
                    f"plan entry {pattern!r}: {style!r}: patterns are strings and styles one of "
                    f"{STYLES}"
                )
        # a copy: a later change to the caller's dict does not change the policy (a plain dict,
        # not a read-only proxy, so that the policy pickles into spawned ranks)
        object.__setattr__(self, "plan", dict(self.plan))
