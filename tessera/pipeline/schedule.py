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
- `interleaved` (interleaved 1F1B, Narayanan et al. 2021, section 2.2.2): each rank holds `v`
  model chunks, rank s the chunks (virtual stages) s, s+p, ..., s+(v-1)p, and the micro-batches
  go through the chunks in groups of p. Each action is 1/v of a stage's work, so the warm-up
  (`2(p-s-1) + (v-1)p` chunk forwards, as Megatron-LM's `forward_backward_pipelining_with_
  interleaving`) fills the pipeline v times sooner: bubble `(p-1)/(v m)`, needs m a multiple of p,
  at the price of v times the messages.

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
    "check_virtual_stages",
    "idle_fraction",
    "max_in_flight",
    "schedule",
    "simulate",
]

SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved")
"""Names `schedule()` knows."""


@dataclass(frozen=True)
class Action:
    """One unit of a stage's work: `kind` "F" (forward) or "B" (backward) of `microbatch`,
    on the stage's model chunk `chunk` (0 but in the interleaved schedule: virtual stage
    `chunk * p + stage`)."""

    kind: str
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f"c{self.chunk}" if self.chunk else "")


def _check(name: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> None:
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {SCHEDULES}")
    if num_stages < 1:
        raise ValueError(f"num_stages must be at least 1, got {num_stages}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be at least 1, got {num_microbatches}")
    check_virtual_stages(name, virtual_stages)
    if name == "interleaved" and num_microbatches % num_stages:
        raise ValueError(
            f"the interleaved schedule runs micro-batches in groups of the {num_stages} stages: "
            f"microbatches={num_microbatches} must be a multiple of {num_stages}"
        )


def check_virtual_stages(name: str, virtual_stages: object) -> None:
    """ValueError unless `virtual_stages` (model chunks per rank) fits schedule `name`."""
    if not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise ValueError(f"virtual_stages must be a positive int, got {virtual_stages!r}")
    if name == "interleaved" and virtual_stages < 2:
        raise ValueError("the interleaved schedule needs virtual_stages >= 2 model chunks per rank")
    if name != "interleaved" and virtual_stages != 1:
        raise ValueError(
            f"virtual_stages={virtual_stages} (model chunks per rank) needs schedule "
            f"'interleaved', not {name!r}"
        )


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


def _chunk_action(kind: str, j: int, num_stages: int, virtual_stages: int) -> Action:
    """The j-th forward (or backward) of a rank in the interleaved order: groups of p
    micro-batches through chunk 0, 1, .., v-1 (backwards through v-1, .., 0)."""
    group, within = divmod(j, num_stages * virtual_stages)
    chunk = within // num_stages
    if kind == "B":
        chunk = virtual_stages - 1 - chunk
    return Action(kind, group * num_stages + within % num_stages, chunk)


def _stage_interleaved(
    stage: int, num_stages: int, num_microbatches: int, virtual_stages: int
) -> list[Action]:
    p, v = num_stages, virtual_stages
    total = num_microbatches * v
    warmup = total if num_microbatches == p else min(2 * (p - stage - 1) + (v - 1) * p, total)
    actions = [_chunk_action("F", j, p, v) for j in range(warmup)]
    for j in range(total - warmup):  # steady state: one forward, one backward
        actions.append(_chunk_action("F", warmup + j, p, v))
        actions.append(_chunk_action("B", j, p, v))
    actions += [_chunk_action("B", j, p, v) for j in range(total - warmup, total)]
    return actions


def schedule(
    name: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1
) -> list[list[Action]]:
    """The action list of every stage (index = stage) of schedule `name`; pure, no processes.

    `virtual_stages` (v, the interleaved schedule only) is the model chunks each stage holds."""
    _check(name, num_stages, num_microbatches, virtual_stages)
    m = num_microbatches
    if name == "interleaved":
        return [_stage_interleaved(s, num_stages, m, virtual_stages) for s in range(num_stages)]
    if name == "naive":
        per_stage = [a for i in range(m) for a in (Action("F", i), Action("B", i))]
        return [list(per_stage) for _ in range(num_stages)]
    if name == "gpipe":
        per_stage = [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]
        return [list(per_stage) for _ in range(num_stages)]
    return [_stage_1f1b(s, num_stages, m) for s in range(num_stages)]


def bubble_fraction(
    name: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1
) -> float:
    """The closed-form bubble of schedule `name`, as the papers define it (see FORMULAS.md).

    naive: `(p-1)/p` and gpipe: `(p-1)/(m+p-1)` are idle shares of the step (GPipe's definition);
    1f1b: `(p-1)/m` and interleaved: `(p-1)/(v m)` are bubble time over ideal time (Narayanan
    et al. 2021's definition, their Eq. 1 and section 2.2.2). The two describe the same idle time:
    `idle_fraction` converts to the idle share for every schedule.
    p=4, m=16: gpipe 0.157895, 1f1b 0.1875, interleaved v=2 0.09375.
    """
    _check(name, num_stages, num_microbatches, virtual_stages)
    p, m = num_stages, num_microbatches
    if name == "interleaved":
        return (p - 1) / (virtual_stages * m)
    if name == "naive":
        return (p - 1) / p
    if name == "gpipe":
        return (p - 1) / (m + p - 1)
    return (p - 1) / m


def idle_fraction(
    name: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1
) -> float:
    """Closed-form idle share of each stage during a step: what a measured timeline shows."""
    bubble = bubble_fraction(name, num_stages, num_microbatches, virtual_stages)
    return bubble / (1 + bubble) if name in ("1f1b", "interleaved") else bubble


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

    F i on virtual stage k (chunk c of stage s: k = c p + s) waits for F i on k-1; B i waits for
    B i on k+1 and for F i on k. With v chunks per stage an action takes 1/v of the given times
    (a chunk holds 1/v of the stage's layers). Transfers take no time. Raises ValueError if the
    schedule deadlocks (a stage waits for an action that comes later in another stage's list).
    """
    num_stages = len(actions)
    chunks = 1 + max((a.chunk for stage in actions for a in stage), default=0)
    last = num_stages * chunks - 1
    forward_time, backward_time = forward_time / chunks, backward_time / chunks
    done: dict[tuple[int, str, int], float] = {}
    position = [0] * num_stages
    free_at = [0.0] * num_stages
    timeline: list[list[tuple[Action, float, float]]] = [[] for _ in range(num_stages)]
    while any(position[s] < len(actions[s]) for s in range(num_stages)):
        progressed = False
        for s in range(num_stages):
            while position[s] < len(actions[s]):
                action = actions[s][position[s]]
                i, k = action.microbatch, action.chunk * num_stages + s
                if action.kind == "F":
                    deps = [(k - 1, "F", i)] if k > 0 else []
                else:
                    deps = [(k, "F", i)] + ([(k + 1, "B", i)] if k < last else [])
                if any(dep not in done for dep in deps):
                    break
                start = max([free_at[s]] + [done[dep] for dep in deps])
                end = start + (forward_time if action.kind == "F" else backward_time)
                done[(k, action.kind, i)] = free_at[s] = end
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
