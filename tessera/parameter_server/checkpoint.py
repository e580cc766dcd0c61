"""Server checkpoints: each server writes its shard atomically; a restarted run resumes from them.

Layout: `DIR/server-S/applied-V.pt`, V the number of gradients the server had applied (a BSP
clock of W workers applies W). A file holds the shard's pieces, its optimizer state, the workers'
clocks and the shard layout (checked on load). Files are written through `tessera._atomic`, so a
crash leaves the previous file or the new one, never half of one.

When: every `checkpoint_every` clocks and, in every mode, once at the end of the run. Under BSP a
clock boundary is the same state on every server. Under ASP and SSP a server saves after every
`checkpoint_every` x W applied gradients (as many as that many BSP clocks); the servers then hold
different sets of gradients (each applies them in arrival order), so each file records which:
the workers' clocks on that server. On resume a worker restarts from the smallest of its clocks
over the servers, and a server skips a gradient it had applied already (`ShardServer.push`): every
worker's update reaches every shard exactly once across the restart.

Resume picks the largest V for which every server has a file. A server keeps its last two files
(`KEEP`): servers are never a whole interval apart (a worker's push goes to all of them before its
next update), so the newest common V is always among them.
"""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

import torch

from tessera._atomic import write_atomically
from tessera.errors import CheckpointError

__all__ = ["KEEP", "latest_common_version", "load_shard", "save_shard"]

FORMAT = "tessera-parameter-server-shard-v1"
_NAME = re.compile(r"applied-(\d+)\.pt$")
KEEP = 2
"""Shard files a server keeps; older ones are deleted once a newer one is written."""


def _path(folder: str | Path, server: int, version: int) -> Path:
    return Path(folder) / f"server-{server}" / f"applied-{version:010d}.pt"


def save_shard(folder: str | Path, server: int, state: dict[str, Any]) -> Path:
    """Write server `server`'s `state` (pieces, optimizer, clocks, layout, version) atomically."""
    buffer = io.BytesIO()
    torch.save({"format": FORMAT, **state}, buffer)
    path = write_atomically(_path(folder, server, state["version"]),
                            lambda f: f.write(buffer.getvalue()))
    for old in sorted(_versions(folder, server))[:-KEEP]:
        _path(folder, server, old).unlink(missing_ok=True)
    return path


def _versions(folder: str | Path, server: int) -> set[int]:
    files = (Path(folder) / f"server-{server}").glob("applied-*.pt")
    return {int(m.group(1)) for f in files if (m := _NAME.search(f.name))}


def latest_common_version(folder: str | Path, num_servers: int) -> int | None:
    """The largest V every server saved, or None when `folder` holds no checkpoint."""
    found = [_versions(folder, server) for server in range(num_servers)]
    if not any(found):
        return None
    common = set.intersection(*found)
    if not common:
        raise CheckpointError(f"{folder}: the servers' checkpoints share no version "
                              f"({[sorted(f)[-3:] for f in found]}); cannot resume consistently")
    return max(common)


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
