"""Automatic restarts of `tessera train`: after a rank fails, run every rank again from the newest
complete checkpoint of the run folder, up to `--max-restarts` times.

The supervisor is the launching process. It starts the ranks (`tessera.launch`), and when one
fails (it raised, it died without a word, or it stopped answering so that its peers' collectives
timed out) the launcher stops them all and the supervisor starts them again with `resume=True`
when the run folder holds a checkpoint that verifies (from scratch otherwise: a folder whose
only checkpoints fail verification starts again from step 0 instead of failing every restart).
The trainer's own resume path does the rest, so a restarted run is exactly a
`tessera train --resume DIR`: same batches, same RNG states, same parameters as a run that never
failed. After `max_restarts` restarts the next failure stops the run with every failure listed
(`RestartsExhausted`).

The restarted trainer writes one `{"event": "restart", "step": S, "rank": R, "cause": ...}` line to
metrics.jsonl (S: the step it resumed from; R: the rank that failed; written by
`tessera.train.metrics.note_restart`), which the summary counts.
Under torchrun (`tessera run --max-restarts K`) the elastic agent restarts the workers instead;
a worker with TORCHELASTIC_RESTART_COUNT > 0 resumes from the run folder by itself.

Elastic world size on one machine (`--min-nproc M`): when a failure LOST a rank (it died without
reporting, or stopped answering), the restart uses the largest world size below the current one,
down to M, that the config accepts (`TrainConfig.check_world_size`: batch_size divisible by it);
when none is, the same size. A rank that raised is a program error, not a lost machine: the world
is kept. The global batch is unchanged (each rank takes batch_size / world of it), so training
follows the same curve within reduction-order noise. Only strategies whose checkpoints load on
any world size take part (those whose `Capabilities` declare `elastic`); the others are refused
up front.

Ranks are started by `tessera.launch`, whose fork server imported torch and the trainer once
(`tessera/runtime/_preload.py`): a restart then costs a fork, not a fresh interpreter importing
torch, per rank.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tessera.errors import ConfigError, LaunchTimeout, RankFailedError, TesseraError
from tessera.runtime.launch import launch
from tessera.strategies.registry import CAPABILITIES, capabilities, strategy_names
from tessera.train.config import TrainConfig
from tessera.train.metrics import RESTART_ENV
from tessera.train.resume import config_layers_for_resume

__all__ = [
    "ELASTIC_STRATEGIES",
    "RESTART_ENV",
    "Failure",
    "RestartsExhausted",
    "check_restart_options",
    "elastic_strategies",
    "has_checkpoint",
    "next_world_size",
    "restarted_by_torchrun",
    "supervise",
]

ELASTIC_STRATEGIES = frozenset(name for name, caps in CAPABILITIES.items() if caps.elastic)
"""tessera's strategies that restart on fewer ranks (`Capabilities.elastic`: their checkpoints do
not depend on the world size: a full replicated state, or ZeRO shards that reshard on load);
`elastic_strategies()` adds the users' that declare it."""


def elastic_strategies() -> list[str]:
    """Every registered strategy that declares `elastic`, sorted."""
    return sorted(name for name in strategy_names() if capabilities(name).elastic)


@dataclass(frozen=True)
class Failure:
    """One failed launch of the ranks."""

    world_size: int
    rank: int | None
    """The rank the launcher reported first (None when it could not tell). After a hang, that is
    the rank whose wait timed out first, not necessarily the one that stopped answering."""
    cause: str
    """The first line of the rank's error."""
    lost: bool
    """The rank died without reporting or stopped answering (not an exception of its own)."""
    permanent: bool = False
    """A config error: it would fail the same way again, so it is not restarted."""

    def describe(self) -> str:
        """One line for the summary of failures."""
        who = "the ranks" if self.rank is None else f"rank {self.rank}"
        return f"{who} of {self.world_size}: {self.cause}"


class RestartsExhausted(RankFailedError):
    """The run failed once more than `--max-restarts` allowed; lists every failure in order.

    A `RankFailedError` (of the last failure's rank), so callers that catch the launcher's error
    catch this one too.
    """

    def __init__(self, failures: list[Failure], max_restarts: int, last: BaseException) -> None:
        self.failures = failures
        self.max_restarts = max_restarts
        self.rank = failures[-1].rank if failures[-1].rank is not None else -1
        self.remote_traceback = getattr(last, "remote_traceback", "")
        lines = "\n".join(f"  {n}. {f.describe()}" for n, f in enumerate(failures, 1))
        why = (
            "a config error is not restarted"
            if failures[-1].permanent
            else f"{max_restarts} restart{'s' if max_restarts != 1 else ''} allowed"
        )
        times = f"{len(failures)} time{'s' if len(failures) != 1 else ''}"
        text = f"the run failed {times} ({why}):\n{lines}"
        if self.remote_traceback:
            text += f"\n\n--- last traceback (rank {self.rank}) ---\n"
            text += self.remote_traceback.rstrip()
        TesseraError.__init__(self, text)


def check_restart_options(config: TrainConfig, max_restarts: int, min_nproc: int | None) -> None:
    """Refuse restart options that cannot work, before anything starts."""
    if max_restarts < 0:
        raise ConfigError(f"--max-restarts must not be negative, got {max_restarts}")
    if min_nproc is None:
        return
    if not 1 <= min_nproc <= config.nproc:
        raise ConfigError(f"--min-nproc must be in 1..nproc ({config.nproc}), got {min_nproc}")
    if not capabilities(config.strategy).elastic:
        raise ConfigError(
            f"--min-nproc: strategy {config.strategy!r} cannot change its world size on a "
            f"restart (its layout or checkpoint is tied to it); elastic strategies: "
            f"{', '.join(elastic_strategies())}"
        )


def next_world_size(
    config: TrainConfig, world: int, failure: Failure, min_nproc: int | None
) -> int:
    """The world size of the restart after `failure` (see the module docstring for the rule)."""
    if min_nproc is None or not failure.lost:
        return world
    for size in range(world - 1, min_nproc - 1, -1):
        try:
            config.check_world_size(size)
        except ConfigError:
            continue
        return size
    return world


def _failure(exc: RankFailedError | LaunchTimeout, world: int) -> Failure:
    if isinstance(exc, LaunchTimeout):
        rank = exc.unfinished_ranks[0] if exc.unfinished_ranks else None
        return Failure(world, rank, str(exc).splitlines()[0], lost=True)
    text = str(exc).splitlines()[0].removeprefix(f"rank {exc.rank} failed: ")
    kind = text.split(":", 1)[0]
    lost = not exc.remote_traceback or "timeout" in kind.lower() or "timed out" in text.lower()
    return Failure(world, exc.rank, text[:300], lost=lost, permanent=kind == "ConfigError")


_COMMUNICATION_ERRORS = ("CollectiveTimeout", "CollectiveMismatch", "PeerLostError")
"""Failures that are the ranks' waits on each other: the records of the others then matter."""


def _drop_stop_records(run_dir: Path, exc: RankFailedError | LaunchTimeout, since: float) -> None:
    """Remove the flight records (`hang-rank-N.json`) this launch's other ranks wrote when one
    rank failed on its own (a ValueError in its model, say): stopped by the launcher's SIGTERM,
    or seeing the failed rank's connection close, they record a hang where nothing hung. After
    a timeout, a lost rank or a communication error they stay: they are the diagnosis."""
    if not isinstance(exc, RankFailedError) or not exc.remote_traceback:
        return
    kind = str(exc).splitlines()[0].removeprefix(f"rank {exc.rank} failed: ").split(":")[0]
    if kind in _COMMUNICATION_ERRORS or kind in ("RuntimeError", "TimeoutError"):
        return  # gloo reports a broken or timed-out collective as a RuntimeError
    for record in Path(run_dir).glob("hang-rank-*.json"):
        try:
            if record.stat().st_mtime >= since:
                record.unlink()
        except OSError:
            continue


def has_checkpoint(run_dir: Path) -> bool:
    """Whether a restart can resume the run folder: its config is there and a checkpoint verifies.

    A folder whose every checkpoint fails verification (each one warns, naming the bad file) is
    restarted from scratch, as one without checkpoints is: resuming it would fail every restart.
    """
    from tessera.checkpoint import series

    try:
        config_layers_for_resume(run_dir)
    except ConfigError:
        return False
    return series.has_verified_checkpoint(run_dir)


def _rank_env(restart: dict[str, Any] | None) -> dict[str, str]:
    """What the ranks of this launch add to this process's environment: the restart, if any."""
    return {RESTART_ENV: json.dumps(restart) if restart else ""}


def supervise(
    config: TrainConfig,
    run_dir: Path,
    resume: bool,
    *,
    max_restarts: int = 0,
    min_nproc: int | None = None,
    callbacks: Sequence[Any] = (),
) -> dict[str, Any] | None:
    """Run the ranks, restarting them after failures; return rank 0's summary. `callbacks` go
    to every rank pickled (`tessera.train.callbacks`)."""
    from tessera.train.loop import train_worker

    check_restart_options(config, max_restarts, min_nproc)
    failures: list[Failure] = []
    world, restart = config.nproc, None
    while True:
        run_config = config if world == config.nproc else dataclasses.replace(config, nproc=world)
        started = time.time() - 1.0  # (file times may round down)
        try:
            return launch(
                train_worker,
                world,
                run_config,
                str(run_dir),
                resume,
                list(callbacks),
                env=_rank_env(restart),
            )[0]
        except (RankFailedError, LaunchTimeout) as exc:
            failure = _failure(exc, world)
            failures.append(failure)
            _drop_stop_records(run_dir, exc, started)
            if max_restarts == 0:
                raise  # no restarts asked for: the launcher's own error, unchanged
            if len(failures) > max_restarts or failure.permanent:
                raise RestartsExhausted(failures, max_restarts, exc) from exc
            world = next_world_size(config, world, failure, min_nproc)
            resume = has_checkpoint(run_dir)
            restart = {
                "restart": len(failures),
                "rank": failure.rank,
                "cause": failure.cause,
                "lost": failure.lost,
                "failed_at": time.time(),
            }


def restarted_by_torchrun() -> bool:
    """Whether this torchrun worker is a restart (its agent restarted the workers)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
