"""Per-step metrics: gathered from every rank, written by rank 0 as one JSON object per line.

Besides the step records, the file holds event lines (`{"event": "restart", ...}`): what happened
to the run. `read_metrics` returns the step records only, `read_events` the events.

Durability: records are appended one line per write. A line that is not a whole record (the last
one, cut short by a kill or a full disk) is dropped with a `RuntimeWarning` naming its line by
every reader, and for good by the next resume, which rewrites the file atomically (a temporary
file renamed over it: a kill during the rewrite leaves the old file whole).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
import warnings
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.distributed as dist

from tessera.checkpoint.atomic import write_atomically

__all__ = [
    "RESTART_ENV",
    "MetricsLog",
    "gather_rank_metrics",
    "note_restart",
    "peak_memory_mb",
    "read_events",
    "read_metrics",
]

RESTART_ENV = "TESSERA_RESTART"
"""JSON the supervisor (`tessera.train.restarts`) gives the ranks of a restarted launch: which
restart, who failed, why; `note_restart` turns it into the run's restart event line."""

RANK_FIELDS = ("loss", "step_s", "data_s", "comm_s", "peak_mem_mb", "model_state_mb")
"""What each rank reports per logged step, in the order of the gathered vector."""


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this rank: allocator peak on CUDA, else the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports kibibytes, macOS bytes.
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def gather_rank_metrics(values: dict[str, float], device: torch.device) -> list[dict[str, float]]:
    """All-gather this rank's `RANK_FIELDS` values; return one dict per rank, in rank order."""
    local = torch.tensor([values[name] for name in RANK_FIELDS], dtype=torch.float64, device=device)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        rows = [local]
    else:
        rows = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, local)
    return [dict(zip(RANK_FIELDS, row.tolist())) for row in rows]


class MetricsLog:
    """Appends records to `metrics.jsonl`; on resume, drops records past the checkpoint's step.

    A run that died after its last checkpoint logged steps that the resumed run will redo;
    keeping both would give two records for one step. Event lines are history: all are kept.
    A torn line is dropped (with a warning). The file is rewritten atomically, so a kill during
    the rewrite leaves the previous file, never a truncated one.
    """

    def __init__(self, path: Path, *, resume_from_step: int = 0) -> None:
        self.path = path
        kept = [
            r for r in _read_lines(path) if "event" in r or r.get("step", 0) <= resume_from_step
        ]

        def fill(file: BinaryIO) -> None:
            for record in kept:
                file.write((json.dumps(record) + "\n").encode())

        write_atomically(path, fill)

    def write(self, record: dict[str, Any]) -> None:
        """Append one record and flush it, so a crash loses at most the current step."""
        with self.path.open("a") as file:
            file.write(json.dumps(record) + "\n")


def _read_lines(path: str | Path) -> list[dict[str, Any]]:
    """The records of the file, without the lines that are not a whole one (each warned)."""
    path = Path(path)
    if not path.exists():
        return []
    records = []
    text = path.read_bytes().decode("utf-8", errors="replace")
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict):  # a torn line parses as nothing, or not as an object
            records.append(record)
            continue
        warnings.warn(
            f"{path}:{number}: dropping a line that is not a whole record (a write cut short "
            f"by a kill or a full disk?): {line[:60]!r}",
            RuntimeWarning,
            stacklevel=3,
        )
    return records


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The step records of a metrics.jsonl file, without event lines (empty if no file)."""
    return [record for record in _read_lines(path) if "event" not in record]


def read_events(path: str | Path, event: str | None = None) -> list[dict[str, Any]]:
    """The event lines of a metrics.jsonl file (only those named `event`, if given)."""
    return [
        record
        for record in _read_lines(path)
        if "event" in record and (event is None or record["event"] == event)
    ]


def note_restart(log: Any, start: int, world_size: int) -> None:
    """Trainer side: if this run is a restart, write its event line to metrics.jsonl (rank 0).

    `start` is the step the trainer resumed from (0: no checkpoint, from scratch).
    """
    if log is None:
        return
    restart = json.loads(os.environ.get(RESTART_ENV) or "null")
    torchrun_restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if restart is None and torchrun_restarts > 0:
        restart = {
            "restart": torchrun_restarts,
            "rank": None,
            "cause": f"torchrun restarted the workers (restart {torchrun_restarts})",
        }
    if restart is None:
        return
    event = {"event": "restart", "step": start, "rank": restart.get("rank")}
    event.update({k: v for k, v in restart.items() if k not in event})
    event.update(world_size=world_size, resumed_at=time.time())
    log.write(event)
