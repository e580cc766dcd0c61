"""Server checkpoints: each server writes its shard atomically; a restarted run resumes from them.

Layout: `DIR/server-S/applied-V.pt`, V the number of gradients the server had applied (a BSP
clock of W workers applies W). A file holds the shard's pieces, its optimizer state, the workers'
clocks and the shard layout (checked on load). Files are written through
`tessera.checkpoint.atomic`, so a crash leaves the previous file or the new one, never half of one.

When: every `checkpoint_every` clocks and, in every mode, once at the end of the run. Under BSP a
clock boundary is the same state on every server. Under ASP and SSP a server saves after every
`checkpoint_every` x W applied gradients (as many as that many BSP clocks); the servers then hold
different sets of gradients (each applies them in arrival order), so each file records which:
the workers' clocks on that server. On resume a worker restarts from the smallest of its clocks
over the servers, and a server skips a gradient it had applied already (`ShardServer.push`): every
worker's update reaches every shard exactly once across the restart.

Resume picks the largest V for which every server has a file (none while some server has never
saved: the run then starts afresh). Which files a server keeps: every file from the `keep`-th
newest version common to all servers on (`keep` >= 1), and nothing older. Servers save at different
moments (under ASP a worker that dies between its pushes to two servers leaves them a gradient
apart for the rest of the run), so a fixed count of newest files per server could delete the only
common version before a newer one exists; this rule never leaves the folder without one. On resume
from V each server deletes its files newer than V (and on a fresh start, all of them): they belong
to the run that crashed, and a later file of the same number from the resumed run must not be mixed
with them.
"""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

import torch

from tessera.checkpoint.atomic import write_atomically
from tessera.errors import CheckpointError

__all__ = ["latest_common_version", "load_shard", "resume_version", "save_shard"]

FORMAT = "tessera-parameter-server-shard-v1"
_NAME = re.compile(r"applied-(\d+)\.pt$")


def _path(folder: str | Path, server: int, version: int) -> Path:
    return Path(folder) / f"server-{server}" / f"applied-{version:010d}.pt"


def save_shard(
    folder: str | Path, server: int, state: dict[str, Any], num_servers: int, keep: int = 1
) -> Path:
    """Write server `server`'s `state` (pieces, optimizer, clocks, layout, version) atomically,
    then delete its files older than the `keep`-th newest version common to all `num_servers`
    servers (a version no other server has, or one older than all `keep`, is never resumed)."""
    buffer = io.BytesIO()
    torch.save({"format": FORMAT, **state}, buffer)
    path = write_atomically(
        _path(folder, server, state["version"]), lambda f: f.write(buffer.getvalue())
    )
    common = sorted(set.intersection(*(_versions(folder, s) for s in range(num_servers))))
    if common:
        oldest_kept = common[-min(keep, len(common))]
        for old in _versions(folder, server):
            if old < oldest_kept:
                _path(folder, server, old).unlink(missing_ok=True)
    return path


def resume_version(folder: str | Path, num_servers: int, server: int) -> int | None:
    """The version server `server` resumes from (None: start afresh), after deleting its files
    newer than it (all of them on a fresh start): they hold the state of the run that crashed.

    Every server calls this before any of them saves again; a deletion here removes only files
    newer than the newest common version, so the servers all find the same one."""
    version = latest_common_version(folder, num_servers)
    for newer in _versions(folder, server):
        if version is None or newer > version:
            _path(folder, server, newer).unlink(missing_ok=True)
    return version


def _versions(folder: str | Path, server: int) -> set[int]:
    files = (Path(folder) / f"server-{server}").glob("applied-*.pt")
    return {int(m.group(1)) for f in files if (m := _NAME.search(f.name))}


def _newest_common(folder: str | Path, num_servers: int) -> int | None:
    common = set.intersection(*(_versions(folder, server) for server in range(num_servers)))
    return max(common, default=None)


def latest_common_version(folder: str | Path, num_servers: int) -> int | None:
    """The largest V every server saved; None when some server has saved nothing (no complete
    checkpoint: start afresh)."""
    found = [_versions(folder, server) for server in range(num_servers)]
    if not all(found):
        return None
    common = _newest_common(folder, num_servers)
    if common is None:  # only by hand: saving never deletes the last common version
        raise CheckpointError(
            f"{folder}: the servers' checkpoints share no version "
            f"({[sorted(f)[-3:] for f in found]}); cannot resume consistently"
        )
    return common


def load_shard(folder: str | Path, server: int, version: int, layout: list) -> dict[str, Any]:
    """Server `server`'s state at `version`, checked against this run's shard `layout`."""
    path = _path(folder, server, version)
    try:
        state = torch.load(path, weights_only=False)
    except Exception as exc:  # noqa: BLE001 - truncated, corrupt or unreadable: one clear error
        raise CheckpointError(f"server {server}: cannot read {path}: {exc}") from exc
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"server {server}: {path} is not a parameter-server shard")
    if state["layout"] != layout:
        raise CheckpointError(
            f"server {server}: {path} holds another shard layout (model or num_servers changed): "
            f"saved {state['layout'][:3]}..., this run {layout[:3]}..."
        )
    return state
