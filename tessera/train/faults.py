"""Fault injection: make one rank fail on purpose at a chosen step, once per run.

`TESSERA_FAULT=RANK:STEP:KIND[,...]` (off when unset or empty). STEP counts optimizer steps from
1, as metrics.jsonl and checkpoints do: a fault at step S fires when rank RANK is about to run
its S-th step. KIND is one of

- `kill`: the rank SIGKILLs itself (no clean-up, no message: a lost process);
- `raise`: the rank raises `InjectedFault` (a crash the launcher reports with its traceback);
- `hang`: the rank stops answering (sleeps; its peers' collectives time out and the run is torn
  down); it gives up by itself only after twice the run's timeout, so a hang never outlives it;
- `slow`: from step S on, the rank sleeps before each step 9 times the duration of its previous
  iteration, so it runs 10 times slower (a straggler; the first step of a restarted run, which
  has no previous iteration, is not slowed);
- `checkpoint`: the rank dies (SIGKILL) in the middle of writing its file of the checkpoint saved
  after step S: half of the first chunk is on disk, the atomic rename never happens. S must be a
  checkpoint step, and the rank must write a file of that checkpoint (every rank of a ZeRO run
  writes its shard; in the other strategies rank 0 writes the one file).

Each fault fires once per run folder: before firing, the rank creates `faults-fired/NAME.json`
exclusively (O_EXCL, fsync'ed), so a restarted run that re-runs step S finds the record and goes
on. The spec is checked whole before anything starts (`check_faults`): a malformed entry is one
ConfigError naming it. The trainer makes one call per step (`FaultInjector.at_step`); everything
else happens here and in `tessera.checkpoint.atomic` (the half-written file).
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tessera.checkpoint import atomic
from tessera.errors import ConfigError, TesseraError

if TYPE_CHECKING:
    from tessera.train.config import TrainConfig

__all__ = [
    "FAULT_ENV",
    "FIRED_FOLDER",
    "KINDS",
    "Fault",
    "FaultInjector",
    "InjectedFault",
    "check_faults",
    "faults_from_env",
    "fired_faults",
    "parse_faults",
]

FAULT_ENV = "TESSERA_FAULT"
KINDS = ("kill", "raise", "hang", "slow", "checkpoint")
FIRED_FOLDER = "faults-fired"
SLOWDOWN = 10
"""A `slow` rank runs this many times slower than it would."""


class InjectedFault(TesseraError):
    """Raised by a `raise` fault (and by a `hang` that nobody ended): a failure made on purpose."""


@dataclass(frozen=True, order=True)
class Fault:
    """One entry of TESSERA_FAULT."""

    rank: int
    step: int
    kind: str

    def __str__(self) -> str:
        return f"{self.rank}:{self.step}:{self.kind}"

    @property
    def record_name(self) -> str:
        """File name of its record in `faults-fired/`."""
        return f"rank{self.rank}-step{self.step}-{self.kind}.json"


def parse_faults(spec: str | None) -> tuple[Fault, ...]:
    """The faults of a TESSERA_FAULT value; ConfigError naming the first malformed entry."""
    if spec is None or not spec.strip():
        return ()
    faults: list[Fault] = []
    expected = f"expected RANK:STEP:KIND with KIND one of {', '.join(KINDS)}"
    for entry in spec.split(","):
        entry = entry.strip()
        parts = entry.split(":")
        where = f"{FAULT_ENV} entry {entry!r}"
        if len(parts) != 3:
            raise ConfigError(f"{where} is malformed: {expected}")
        rank, step, kind = (part.strip() for part in parts)
        if not rank.isdigit():
            raise ConfigError(f"{where}: rank {rank!r} is not a number >= 0; {expected}")
        if not step.isdigit() or int(step) < 1:
            raise ConfigError(f"{where}: step {step!r} is not a number >= 1; {expected}")
        if kind not in KINDS:
            raise ConfigError(f"{where}: unknown kind {kind!r}; {expected}")
        fault = Fault(int(rank), int(step), kind)
        if any((f.rank, f.step) == (fault.rank, fault.step) for f in faults):
            raise ConfigError(f"{where}: rank {rank} already has a fault at step {step}")
        faults.append(fault)
    return tuple(faults)


def is_checkpoint_step(step: int, config: TrainConfig) -> bool:
    """Whether the trainer saves a checkpoint after `step` (1-based)."""
    every = config.checkpoint_every
    return step == config.steps or (every > 0 and step % every == 0)


def check_faults(
    faults: tuple[Fault, ...], config: TrainConfig, world_size: int | None, *, sharded: bool
) -> None:
    """Refuse faults that could never fire in this run; `sharded`: every rank writes a file.

    `world_size` None skips the rank check (a restart on fewer ranks keeps the spec: the faults
    of ranks that no longer exist do not fire).
    """
    for fault in faults:
        where = f"{FAULT_ENV} entry {str(fault)!r}"
        if world_size is not None and fault.rank >= world_size:
            raise ConfigError(f"{where}: rank {fault.rank} does not exist ({world_size} ranks)")
        if fault.step > config.steps:
            raise ConfigError(f"{where}: step {fault.step} is past the last ({config.steps})")
        if fault.kind != "checkpoint":
            continue
        if not is_checkpoint_step(fault.step, config):
            raise ConfigError(
                f"{where}: no checkpoint is saved after step {fault.step} "
                f"(checkpoint_every {config.checkpoint_every}, steps {config.steps})"
            )
        if not sharded and fault.rank != 0:
            raise ConfigError(
                f"{where}: rank {fault.rank} writes no checkpoint file under strategy "
                f"{config.strategy!r} (rank 0 writes it); put the fault on rank 0"
            )


def faults_from_env(config: TrainConfig, world_size: int) -> tuple[Fault, ...]:
    """TESSERA_FAULT, parsed and checked against a run before any rank starts."""
    faults = parse_faults(os.environ.get(FAULT_ENV))
    if faults:
        from tessera.strategies.registry import STRATEGIES  # the builder says how it saves

        sharded = bool(getattr(STRATEGIES[config.strategy], "sharded_checkpoint", False))
        check_faults(faults, config, world_size, sharded=sharded)
    return faults


def fired_faults(run_dir: str | Path) -> list[dict]:
    """The records of the faults that fired in a run folder (time order)."""
    folder = Path(run_dir) / FIRED_FOLDER
    records = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        text = path.read_text()
        records.append(json.loads(text) if text.strip() else {"file": path.name})
    return sorted(records, key=lambda record: record.get("time", 0.0))


class FaultInjector:
    """This rank's faults, fired by `at_step`; does nothing when TESSERA_FAULT is unset."""

    def __init__(
        self, faults: tuple[Fault, ...], run_dir: str | Path, rank: int, timeout_s: float
    ) -> None:
        self.pending = {f.step: f for f in faults if f.rank == rank}
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.timeout_s = timeout_s
        self._slow = False
        self._last_mark: float | None = None

    @classmethod
    def from_env(
        cls, run_dir: str | Path, rank: int, config: TrainConfig, *, sharded: bool
    ) -> FaultInjector:
        """Read and check TESSERA_FAULT for this rank of this run (ranks checked up front)."""
        faults = parse_faults(os.environ.get(FAULT_ENV))
        check_faults(faults, config, None, sharded=sharded)
        return cls(faults, run_dir, rank, config.timeout_s)

    def at_step(self, step: int) -> None:
        """Called before the trainer runs (1-based) `step`: fire this rank's fault of that step."""
        atomic.arm_write_crash(None)  # a `checkpoint` fault covers its own step's save only
        now = time.perf_counter()
        previous_s = None if self._last_mark is None else now - self._last_mark
        fault = self.pending.pop(step, None)
        if fault is not None and fault.kind == "checkpoint":  # recorded when it fires
            atomic.arm_write_crash(lambda: self._claim(fault))
        elif fault is not None and self._claim(fault):
            self._fire(fault)
        if self._slow and previous_s is not None:  # the first step of a run has no previous
            time.sleep((SLOWDOWN - 1) * previous_s)
        self._last_mark = time.perf_counter()

    def _fire(self, fault: Fault) -> None:
        if fault.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.kind == "raise":
            raise InjectedFault(f"rank {self.rank}: injected fault {fault} ({FAULT_ENV})")
        elif fault.kind == "hang":
            self._hang(fault)
        else:  # slow
            self._slow = True

    def _claim(self, fault: Fault) -> bool:
        """Record `fault` as fired, unless an earlier run of this folder fired it already."""
        folder = self.run_dir / FIRED_FOLDER
        folder.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(folder / fault.record_name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        record = {"rank": fault.rank, "step": fault.step, "kind": fault.kind, "time": time.time()}
        with os.fdopen(fd, "w") as file:
            file.write(json.dumps(record))
            file.flush()
            os.fsync(file.fileno())
        atomic.fsync_folder(folder)  # the record survives the kill that follows
        return True

    def _hang(self, fault: Fault) -> None:
        limit = 2 * self.timeout_s
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        raise InjectedFault(
            f"rank {self.rank}: injected fault {fault} hung for {limit:g} s and nobody stopped it "
            "(its peers should have timed out)"
        )
