"""The `tessera train` command line that runs a planned strategy, or why tessera cannot run it.

A plan row is worth printing only if the user can run it: `train_command` maps a `Strategy`
(dp x tp x pp, ZeRO stage, offload, schedule, recomputation) to the trainer's flags, the same
flags `tessera train --help` lists, so every printed command parses with tessera's own parser
into a config its validator accepts. What the planner prices but the trainer does not run is
said instead of a command: activation recomputation inside pipeline or tensor-parallel stages
(the trainer's checkpointing wraps the whole GPT's blocks), ZeRO-3 beside tensor parallelism
(the hybrid shards with ZeRO-1/2), a batch the ranks do not divide (the trainer's loader gives
each rank batch / ranks rows), a model known only by its parameter count. A cluster of
several nodes gets the `tessera run` line each node starts (torchrun's rendezvous: the host,
port and each node's --node-rank are the user's).
"""

from __future__ import annotations

import shlex
import tempfile
from dataclasses import dataclass

from tessera.plan.cluster import Cluster
from tessera.plan.search import Strategy

__all__ = ["TrainCommand", "model_flags", "train_command"]


@dataclass(frozen=True)
class TrainCommand:
    """The command line of one plan row (`argv` after `tessera`), or why there is none."""

    argv: tuple[str, ...] | None
    why_not: str = ""

    @property
    def text(self) -> str:
        """The command as a shell line ("" when tessera cannot run the row)."""
        return "tessera " + shlex.join(self.argv) if self.argv else ""


def model_flags(
    model: str, *, layers: int = 0, hidden: int = 0, heads: int = 0, seq: int = 0
) -> tuple[str, ...] | None:
    """The trainer's flags for the planned model: the demo GPT's shape (`--model gpt`; its
    vocabulary comes from the corpus), a user's `--model` as given (its `--data` is the user's
    to add), None for a bare parameter count (nothing to run)."""
    if model == "gpt":
        if not (layers and hidden and heads and seq):
            return None
        return ("--n-layer", str(layers), "--n-embd", str(hidden), "--n-head", str(heads),
                "--block-size", str(seq))  # fmt: skip
    return ("--model", model)


def _strategy_flags(s: Strategy) -> list[str]:
    """`--strategy` and the knobs of its policy (dp x tp x pp, ZeRO, schedule, offload)."""
    pipeline = ["--microbatches", str(s.microbatches), "--schedule", s.schedule]
    if s.schedule == "interleaved":
        pipeline += ["--virtual-stages", str(s.chunks)]
    accumulate = ["--grad-accum", str(s.microbatches)] if s.microbatches > 1 else []
    if s.tp == 1 and s.pp == 1:
        flags = ["--strategy", f"zero{s.zero}" if s.zero else "ddp", *accumulate]
        if s.offload:
            flags += ["--offload", s.offload]
            if s.offload == "nvme":  # an existing writable folder: the swap files' home
                flags += ["--nvme-dir", tempfile.gettempdir()]
        return flags
    if s.dp == 1 and s.pp == 1:
        return ["--strategy", "tensor", *accumulate]
    if s.dp == 1 and s.tp == 1:
        return ["--strategy", "pipeline", *pipeline]
    flags = ["--strategy", "hybrid", "--dp", str(s.dp), "--tp", str(s.tp), "--pp", str(s.pp)]
    return flags + (["--zero", str(s.zero)] if s.zero else []) + pipeline


def train_command(
    s: Strategy,
    model: tuple[str, ...] | None,
    cluster: Cluster,
    *,
    batch: int,
    precision: str = "mixed",
) -> TrainCommand:
    """The `tessera train` (several nodes: `tessera run ... -m tessera train`) line of `s` for
    the model flags `model` (`model_flags`) and a global batch of `batch` sequences."""
    if model is None:
        return TrainCommand(None, "a parameter count names no model to train (give --model)")
    if s.recompute and (s.tp > 1 or s.pp > 1):
        return TrainCommand(
            None,
            "recomputation inside tensor-parallel or pipeline stages: tessera's "
            "--activation-checkpointing wraps the whole GPT (ddp, zero1-3)",
        )
    if s.zero == 3 and (s.tp > 1 or s.pp > 1):
        return TrainCommand(
            None, "ZeRO-3 with model parallelism: tessera's hybrid takes zero 1 or 2"
        )
    devices = s.dp * s.tp * s.pp
    if batch % devices:
        return TrainCommand(
            None,
            f"the trainer's data loader gives each of the {devices} ranks batch / ranks "
            f"sequences: --batch {batch} does not divide",
        )
    flags = [*_strategy_flags(s), "--batch-size", str(batch), "--optimizer", "adamw"]
    flags += list(model)
    if precision == "mixed":
        flags += ["--mixed-precision", "bf16"]
    if s.recompute:
        flags.append("--activation-checkpointing")
    if devices <= cluster.per_node:
        return TrainCommand(("train", *flags, "--nproc", str(devices)))
    nodes = devices // cluster.per_node
    run = ["run", "--nnodes", str(nodes), "-n", str(cluster.per_node)]
    run += ["--rdzv-endpoint", "HOST:PORT", "-m", "tessera", "train"]
    return TrainCommand((*run, *flags))
