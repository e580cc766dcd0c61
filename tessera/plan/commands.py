"""The `tessera train` command line that runs a planned strategy, or why tessera cannot run it.

A plan row is worth printing only if the user can run it: `train_command` maps a `Strategy`
(dp x tp x pp, ZeRO stage, offload, schedule, recomputation) to the trainer's flags, the same
flags `tessera train --help` lists, so every printed command parses with tessera's own parser
into a config its validator accepts. What the planner prices but the trainer does not run is
said instead of a command: activation recomputation inside pipeline or tensor-parallel stages
(the trainer's checkpointing wraps the whole GPT's blocks), ZeRO-3 beside tensor parallelism
(the hybrid shards with ZeRO-1/2), a micro-batch the ranks do not divide (the trainer's loader
gives each rank batch_size / ranks rows), a model known only by its parameter count. A cluster of
several nodes gets the `tessera run` line each node starts (torchrun's rendezvous: the host,
port and each node's --node-rank are the user's).
"""

from __future__ import annotations

import shlex
import tempfile
from dataclasses import dataclass
from typing import Any

from tessera.plan.cluster import Cluster
from tessera.plan.search import Strategy

__all__ = ["TrainCommand", "model_flags", "strategy_layer", "train_command"]


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


def strategy_layer(s: Strategy, batch: int) -> dict[str, Any]:
    """The trainer's config values (`TrainConfig` keys) that run strategy `s` on a global batch
    of `batch` sequences per optimizer step: `--strategy` and its policy (dp x tp x pp, ZeRO,
    schedule, offload, recomputation). The printed command's flags and `tessera compare`'s run
    of a plan row (`train.compare.plan_run`) both come from here, so they cannot disagree.

    Without a pipeline the planner's m micro-batches are gradient accumulation: the trainer's
    `batch_size` is the global micro-batch (batch / m) and `grad_accum` m, so one optimizer step
    takes `batch` sequences, as the planner priced it. A pipeline (or hybrid) splits its
    `batch_size` into `microbatches` itself."""
    m = s.microbatches
    accumulate = {"grad_accum": m} if m > 1 else {}
    layer: dict[str, Any]
    if s.tp == 1 and s.pp == 1:
        layer = {"strategy": f"zero{s.zero}" if s.zero else "ddp", **accumulate}
        if s.offload:
            layer["offload"] = s.offload
            if s.offload == "nvme":  # an existing writable folder: the swap files' home
                layer["nvme_dir"] = tempfile.gettempdir()
        layer["batch_size"] = batch // m
    elif s.dp == 1 and s.pp == 1:
        layer = {"strategy": "tensor", **accumulate, "batch_size": batch // m}
    else:
        if s.dp == 1 and s.tp == 1:
            layer = {"strategy": "pipeline"}
        else:
            layer = {"strategy": "hybrid", "dp": s.dp, "tp": s.tp, "pp": s.pp}
            layer.update({"zero": s.zero} if s.zero else {})
        layer.update(microbatches=m, schedule=s.schedule)
        layer.update({"virtual_stages": s.chunks} if s.schedule == "interleaved" else {})
        layer["batch_size"] = batch
    if s.recompute:
        layer["activation_checkpointing"] = True
    return layer


def _flags(layer: dict[str, Any]) -> list[str]:
    """`strategy_layer`'s values as the trainer's flags (`--grad-accum 2`, a bare flag for True)."""
    flags: list[str] = []
    for key, value in layer.items():
        flag = "--" + key.replace("_", "-")
        flags += [flag] if value is True else [flag, str(value)]
    return flags


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
    layer = strategy_layer(s, batch)
    if layer["batch_size"] % devices:
        return TrainCommand(
            None,
            f"the trainer's data loader gives each of the {devices} ranks batch_size / ranks "
            f"sequences: --batch {batch} in {s.microbatches} micro-batches does not divide",
        )
    checkpointing = layer.pop("activation_checkpointing", False)
    flags = [*_flags(layer), "--optimizer", "adamw", *model]
    if precision == "mixed":
        flags += ["--mixed-precision", "bf16"]
    if checkpointing:
        flags.append("--activation-checkpointing")
    if devices <= cluster.per_node:
        return TrainCommand(("train", *flags, "--nproc", str(devices)))
    nodes = devices // cluster.per_node
    run = ["run", "--nnodes", str(nodes), "-n", str(cluster.per_node)]
    run += ["--rdzv-endpoint", "HOST:PORT", "-m", "tessera", "train"]
    return TrainCommand((*run, *flags))
