"""Pipeline schedules as data: per-stage lists of forward and backward actions.

A pipeline of `p` stages trains a batch split into `m` micro-batches. A schedule says, for each
stage, in which order it runs the forward (`F`) and backward (`B`) pass of each micro-batch. It is
pure data: `schedule()` never communicates, the runner (`runner.py`) is the only code that sends.
Messages are implied by the actions: after `F i` a stage sends micro-batch i's activation to the
next stage, and after `B i` its input gradient to the previous one.

- `naive`: layer splitting without pipelining (model parallelism as in the first multi-device
  nets): micro-batch i goes forward through every stage and back before micro-batch i+1 starts;
  one stage works at a time. Idle fraction `(p-1)/p` whatever m.
- `gpipe` (Huang et al. 2019, "GPipe"): all m forwards, then all m backwards. Idle fraction
  `(p-1)/(m+p-1)`; each stage keeps the activations of all m micro-batches until its backwards.
- `1f1b` (PipeDream-Flush, Narayanan et al. 2021): stage s runs `p-s-1` warm-up forwards, then
  alternates one forward and one backward, then drains the remaining backwards. The same idle time
  as GPipe, but at most `p - s <= p` micro-batches in flight (activation memory O(p), not O(m)).

`simulate()` runs a schedule on a model of time (fixed forward and backward durations, zero
transfer time) and so checks that it cannot deadlock and gives its idle fraction: the tests compare
it with the closed forms of `bubble_fraction` / `idle_fraction`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "SCHEDULES",
    "Action",
    "bubble_fraction",
    "idle_fraction",
    "max_in_flight",
    "schedule",
    "simulate",
]

SCHEDULES = ("naive", "gpipe", "1f1b")
"""Names `schedule()` knows."""


@dataclass(frozen=True)
class Action:
    """One unit of a stage's work: `kind` "F" (forward) or "B" (backward) of `microbatch`."""

    kind: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"


def _check(name: str, num_stages: int, num_microbatches: int) -> None:
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {SCHEDULES}")
    if num_stages < 1:
        raise ValueError(f"num_stages must be at least 1, got {num_stages}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be at least 1, got {num_microbatches}")


def _stage_1f1b(stage: int, num_stages: int, num_microbatches: int) -> list[Action]:
    warmup = min(num_stages - stage - 1, num_microbatches)
    actions = [Action("F", i) for i in range(warmup)]
    next_forward, next_backward = warmup, 0
    while next_forward < num_microbatches:  # steady state: one forward, one backward
        actions.append(Action("F", next_forward))
        actions.append(Action("B", next_backward))
        next_forward += 1
        next_backward += 1
    actions += [Action("B", i) for i in range(next_backward, num_microbatches)]  # cool-down
    return actions


def schedule(name: str, num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """The action list of every stage (index = stage) of schedule `name`; pure, no processes."""
    _check(name, num_stages, num_microbatches)
    m = num_microbatches
    if name == "naive":
        per_stage = [a for i in range(m) for a in (Action("F", i), Action("B", i))]
        return [list(per_stage) for _ in range(num_stages)]
    if name == "gpipe":
        per_stage = [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]
        return [list(per_stage) for _ in range(num_stages)]
    return [_stage_1f1b(s, num_stages, m) for s in range(num_stages)]


def bubble_fraction(name: str, num_stages: int, num_microbatches: int) -> float:
    """The closed-form bubble of schedule `name`, as the papers define it (see FORMULAS.md).

    naive: `(p-1)/p` and gpipe: `(p-1)/(m+p-1)` are idle shares of the step (GPipe's definition);
    1f1b: `(p-1)/m` is bubble time over ideal time (Narayanan et al. 2021's definition). The two
    describe the same idle time: `idle_fraction` converts to the idle share for every schedule.
    p=4, m=16: gpipe 0.157895, 1f1b 0.1875.
    """
    _check(name, num_stages, num_microbatches)
    p, m = num_stages, num_microbatches
    if name == "naive":
        return (p - 1) / p
    if name == "gpipe":
        return (p - 1) / (m + p - 1)
    return (p - 1) / m


def idle_fraction(name: str, num_stages: int, num_microbatches: int) -> float:
    """Closed-form idle share of each stage during a step: what a measured timeline shows."""
    bubble = bubble_fraction(name, num_stages, num_microbatches)
    return bubble / (1 + bubble) if name == "1f1b" else bubble


def max_in_flight(actions: list[Action]) -> int:
    """Most micro-batches forwarded but not yet backwarded at once (activations held)."""
    live, most = 0, 0
    for action in actions:
        live += 1 if action.kind == "F" else -1
        most = max(most, live)
    return most


def simulate(
    actions: list[list[Action]], forward_time: float = 1.0, backward_time: float = 2.0
) -> list[list[tuple[Action, float, float]]]:
    """Run a schedule on a time model; return each stage's `(action, start, end)` in order.

    F i on stage s waits for F i on stage s-1; B i waits for B i on stage s+1 and for F i on
    stage s. Transfers take no time. Raises ValueError if the schedule deadlocks (a stage waits for
    an action that comes later in another stage's list) or is incomplete.
    """
    num_stages = len(actions)
    done: dict[tuple[int, str, int], float] = {}
    position = [0] * num_stages
    free_at = [0.0] * num_stages
    timeline: list[list[tuple[Action, float, float]]] = [[] for _ in range(num_stages)]
    while any(position[s] < len(actions[s]) for s in range(num_stages)):
        progressed = False
        for s in range(num_stages):
            while position[s] < len(actions[s]):
                action = actions[s][position[s]]
                i = action.microbatch
                if action.kind == "F":
                    deps = [(s - 1, "F", i)] if s > 0 else []
                else:
                    deps = [(s, "F", i)] + ([(s + 1, "B", i)] if s < num_stages - 1 else [])
                if any(dep not in done for dep in deps):
                    break
                start = max([free_at[s]] + [done[dep] for dep in deps])
                end = start + (forward_time if action.kind == "F" else backward_time)
                done[(s, action.kind, i)] = free_at[s] = end
                timeline[s].append((action, start, end))
                position[s] += 1
                progressed = True
        if not progressed:
            stuck = {
                s: str(actions[s][position[s]])
                for s in range(num_stages)
                if position[s] < len(actions[s])
            }
            raise ValueError(f"schedule deadlocks: stages wait at {stuck}")
    return timeline
