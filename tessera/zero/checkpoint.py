"""Sharded ZeRO checkpoints: one shard per rank, resharding on load, streaming consolidation.

A rank's shard is two files in the step's folder:

* `rank-R-of-W.safetensors`: the runs of elements the rank owns (`partition.shard_pieces`) of the
  fp32 master weights and of every element-wise optimizer state, one tensor per run, keyed
  `kind|parameter|first element` (rank 0 adds the buffers, `extra|key|0`); written atomically;
* `rank-R-of-W.pt`: written last with `tessera.checkpoint.files.save_checkpoint` (atomic, a
  plain `torch.save` file; in a run folder the checkpoint's manifest holds its checksum): the
  layout, optimizer hyper-parameters, each flat shard's scalar state (Adam's `step`: every flat
  keeps its own tensor) and the SHA-256 of the tensor file, which every reader verifies before
  trusting a byte of it.

Under a one-step delayed update (`tessera.zero.delayed`) a save first waits for the step in
flight: the masters and optimizer state saved are those after it, and the parameters forward
sees, one step behind, are saved too (kind `stale`) with the step count, so that a resumed run
continues exactly as one that never stopped.

A save is atomic per checkpoint, not only per file: every rank writes into `.NAME.partial` and
group rank 0 renames it to `NAME` once all shards are complete, so a folder never mixes the
shards of two saves (or two world sizes).

The files name parameters, not buckets or ranks, so:

* resume on another world size reads, from every old shard, only the runs that overlap the
  slices this rank now owns (memory: this rank's new shard plus one run);
* under offload='nvme' the masters and moments in the optimizer's files are saved and loaded
  chunk by chunk through its staging buffer (`tessera.zero._offloaded_state`): a checkpoint
  stays within `nvme_buffer_mb` like a step;
* `consolidate` lays out one plain safetensors state dict and fills it run by run, so its memory
  is bounded by the largest tensor, never the model; `safetensors.torch.load_file` and
  `nn.Module.load_state_dict` read it without tessera.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tessera.checkpoint.atomic import fsync_folder, pause_point, write_atomically
from tessera.errors import CheckpointError
from tessera.zero._offloaded_state import (
    MOMENTS,
    FileRun,
    FileSink,
    file_sinks,
    inner_state,
    master_source,
    run_of,
)
from tessera.zero._safetensors import (
    TensorFile,
    file_sha256,
    layout,
    tensor_bytes,
    write_tensors,
)
from tessera.zero.partition import shard_pieces

__all__ = ["consolidate", "load_shard_files", "load_shards", "save_shard", "shard_file_name"]

FORMAT = "tessera-zero-shard/3"
"""/3: optimizer scalars (Adam's `step`) and state kinds are saved per flat shard."""
_FORMAT_2 = "tessera-zero-shard/2"
"""Still read: its one set of scalars is given to every flat (each its own copy)."""
_SHARD_FILE = re.compile(r"rank-(\d+)-of-(\d+)\.pt$")


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """`tessera.checkpoint.files.load_checkpoint`: the verified file reader."""
    from tessera.checkpoint.files import load_checkpoint as load_verified

    return load_verified(path)


def shard_file_name(rank: int, world_size: int) -> str:
    """The name of one rank's metadata file (its tensors: the same with `.safetensors`)."""
    return f"rank-{rank:05d}-of-{world_size:05d}.pt"


def _parameter_keys(optimizer: Any) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """state_dict key -> parameter name for sharded parameters; the other tensors (buffers)."""
    sharded = {name for flat in optimizer.flats for name in flat.layout.names}
    names = {id(p): name for name, p in optimizer.module.named_parameters()}
    params, extras = {}, {}
    for key, tensor in optimizer.module.state_dict(keep_vars=True).items():
        if names.get(id(tensor)) in sharded:
            params[key] = names[id(tensor)]
        else:
            extras[key] = tensor.detach()
    return params, extras


def save_shard(folder: str | Path, optimizer: Any, **extra: Any) -> Path:
    """Write every rank's shard of a ZeRO optimizer (`ZeroStage1/2/3`) into `folder`. Collective.

    The ranks write into a sibling `.NAME.partial` folder, which group rank 0 renames to `folder`
    once every shard is complete: a save that dies midway (an exception, `kill -9`) leaves only
    the partial folder, which the next save into `folder` clears, never a stray shard inside
    `folder` that would make it unloadable. An existing `folder` is replaced (moved aside just
    before the rename, deleted after it). Returns this rank's metadata file.
    """
    folder = Path(folder)
    partial = folder.parent / f".{folder.name}.partial"
    if optimizer.rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # what a save that died here left behind
        partial.mkdir(parents=True)
    _barrier(optimizer)  # nobody writes before the partial folder is fresh
    name = _write_shard(partial, optimizer, extra)
    _barrier(optimizer)  # every shard is complete
    if optimizer.rank == 0:
        pause_point(f"commit:{folder}")
        _replace_folder(partial, folder)
    _barrier(optimizer)  # no rank returns (and, say, loads) before the rename
    return folder / name


def _barrier(optimizer: Any) -> None:
    """Wait for every rank of the optimizer's group, with the optimizer's timeout."""
    if optimizer.world > 1:
        optimizer.collectives.run(dist.barrier, optimizer.group)


def _replace_folder(new: Path, target: Path) -> None:
    """Rename `new` to `target`, replacing a previous `target`; fsync the parent folder.

    POSIX cannot rename a folder over a non-empty one, so the old one is first moved aside
    (`.NAME.old`): a crash between the two renames leaves it there, not deleted.
    """
    old = target.parent / f".{target.name}.old"
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        os.replace(target, old)
    os.replace(new, target)
    fsync_folder(target.parent)
    shutil.rmtree(old, ignore_errors=True)


def _write_shard(folder: Path, optimizer: Any, extra: dict[str, Any]) -> str:
    """Write this rank's two files into `folder`; return the metadata file's name."""
    delayed = getattr(optimizer, "delayed", None)
    if delayed is not None:
        optimizer.wait_for_step()  # the step in flight is part of the state saved
    params, extras = _parameter_keys(optimizer)
    tensors: dict[str, Any] = {}
    flat_state = []
    for flat in optimizer.flats:
        sources: dict[str, Any] = {"param": master_source(optimizer, flat)}
        if delayed is not None and delayed.unpublished:  # what forward sees: one step behind
            sources["stale"] = optimizer.visible_slice(flat)
        scalars: dict[str, Any] = {}
        for kind, value in inner_state(optimizer.optimizer, flat.master).items():
            if isinstance(value, (torch.Tensor, FileRun)) and value.shape == flat.master.shape:
                sources[kind] = value
            else:
                scalars[kind] = value  # e.g. Adam's step count (one per flat, each its own)
        flat_state.append({"kinds": [k for k in sources if k != "param"], "scalars": scalars})
        for piece in shard_pieces(flat.layout, optimizer.world, optimizer.rank):
            end = piece.shard_lo + piece.param_hi - piece.param_lo
            for kind, source in sources.items():
                key = f"{kind}|{piece.name}|{piece.param_lo}"
                tensors[key] = run_of(source, piece.shard_lo, end)
    if optimizer.rank == 0:
        tensors.update({f"extra|{key}|0": tensor for key, tensor in extras.items()})
    name = shard_file_name(optimizer.rank, optimizer.world)
    tensor_file = name.replace(".pt", ".safetensors")
    digest = write_tensors(folder / tensor_file, tensors)
    meta = {
        "format": FORMAT,
        "stage": optimizer.stage,
        "rank": optimizer.rank,
        "world_size": optimizer.world,
        "keys": list(optimizer.module.state_dict(keep_vars=True)),
        "params": params,
        "extra_keys": list(extras),
        "shapes": {
            n: list(s) for f in optimizer.flats for n, s in zip(f.layout.names, f.layout.shapes)
        },
        "flat_state": flat_state,
        "param_groups": [
            {k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups
        ],
        "tensors": tensor_file,
        "sha256": digest,
        **extra,
    }
    if delayed is not None:
        meta["delayed"] = {"steps": delayed.steps, "unpublished": delayed.unpublished}
    from tessera.checkpoint.files import save_checkpoint

    save_checkpoint(folder / name, meta)
    return name


def load_shard_files(folder: str | Path) -> list[dict[str, Any]]:
    """Every rank's shard metadata in `folder`, in rank order; refuses an incomplete set."""
    folder = Path(folder)
    found = {}
    for path in folder.glob("rank-*-of-*.pt"):
        if match := _SHARD_FILE.search(path.name):
            found[(int(match[1]), int(match[2]))] = path
    if not found:
        raise CheckpointError(f"no ZeRO shard files (rank-*-of-*.pt) in {folder}")
    worlds = {world for _, world in found}
    if len(worlds) != 1:
        raise CheckpointError(f"{folder}: expected the shards of one world size, found {worlds}")
    world = worlds.pop()
    missing = [r for r in range(world) if (r, world) not in found]
    if missing:
        raise CheckpointError(f"{folder}: shard files of ranks {missing} (of {world}) are missing")
    metas = [load_checkpoint(found[(r, world)]) for r in range(world)]
    if any(meta.get("format") not in (FORMAT, _FORMAT_2) for meta in metas):
        raise CheckpointError(f"{folder}: not a tessera ZeRO shard checkpoint ({FORMAT})")
    return metas


def _open_verified(folder: Path, meta: dict[str, Any]) -> TensorFile:
    path = folder / meta["tensors"]
    if not path.is_file():
        raise CheckpointError(f"shard tensors not found: {path}")
    if file_sha256(path) != meta["sha256"]:
        raise CheckpointError(f"{path} is corrupt: checksum mismatch")
    return TensorFile(path)


def _check_compatible(optimizer: Any, meta: dict[str, Any]) -> None:
    ours = {n: list(s) for f in optimizer.flats for n, s in zip(f.layout.names, f.layout.shapes)}
    theirs = meta["shapes"]
    for name in sorted(set(ours) | set(theirs)):
        if ours.get(name) != theirs.get(name):
            raise CheckpointError(
                f"checkpoint is from another model: parameter {name!r} has shape "
                f"{theirs.get(name)} in the checkpoint and {ours.get(name)} in this model"
            )
    _, extras = _parameter_keys(optimizer)
    for key in sorted(set(extras) ^ set(meta["extra_keys"])):
        raise CheckpointError(f"checkpoint is from another model: buffer {key!r} differs")
    if len(meta["param_groups"]) != len(optimizer.param_groups):
        raise CheckpointError(
            f"checkpoint is from another optimizer: it has {len(meta['param_groups'])} parameter "
            f"groups, this optimizer {len(optimizer.param_groups)}"
        )
    saved = set(meta["param_groups"][0]) if meta["param_groups"] else set()
    current = {k for k in optimizer.param_groups[0] if k != "params"}
    if saved != current:
        raise CheckpointError(
            f"checkpoint is from another optimizer: options {sorted(saved ^ current)}"
        )


def _read_my_runs(
    optimizer: Any, folder: Path, metas: list[dict[str, Any]], sinks: list[dict[str, FileSink]]
) -> tuple[list, dict]:
    """Per flat, kind -> this rank's new slice, read from the overlapping runs of every shard;
    the kinds in `sinks` are written into their files instead, chunk by chunk.

    Every shard's checksum and, from the headers, the coverage of this rank's slices are checked
    before anything is read or written: a file sink writes into the optimizer's live files."""
    wanted: dict[str, list[tuple[int, int, int, int]]] = {}
    expected = []
    for index, flat in enumerate(optimizer.flats):
        pieces = shard_pieces(flat.layout, optimizer.world, optimizer.rank)
        expected.append(sum(p.param_hi - p.param_lo for p in pieces))
        for p in pieces:
            wanted.setdefault(p.name, []).append((p.param_lo, p.param_hi, index, p.shard_lo))
    slices: list[dict[str, torch.Tensor]] = [{} for _ in optimizer.flats]
    extras: dict[str, torch.Tensor] = {}
    copies = []  # (shard, key, first element of the run, overlap start, end, flat, shift)
    filled: dict[tuple[int, str], int] = {}
    for number, meta in enumerate(metas):  # one file open at a time (a reshard may read many)
        with _open_verified(folder, meta) as tensors:
            for key in tensors.keys():
                kind, name, first = key.split("|")
                if kind == "extra":
                    extras[name] = tensors.get(key)
                    continue
                lo, hi = int(first), int(first) + tensors.numel(key)
                for param_lo, param_hi, index, shard_lo in wanted.get(name, []):
                    start, end = max(param_lo, lo), min(param_hi, hi)
                    if start < end:
                        copies.append((number, key, lo, start, end, index, shard_lo - param_lo))
                        filled[(index, kind)] = filled.get((index, kind), 0) + end - start
    for (index, kind), count in filled.items():
        if count != expected[index]:
            raise CheckpointError(
                f"the shards cover {count} of {expected[index]} elements ({kind})"
            )
    for mine in sinks:
        for sink in mine.values():
            sink.clear()
    for number, meta in enumerate(metas):
        with TensorFile(folder / meta["tensors"]) as tensors:  # verified above
            for _, key, lo, start, end, index, shift in (c for c in copies if c[0] == number):
                kind = key.split("|", 1)[0]
                sink = sinks[index].get(kind)
                if sink is None:
                    size = optimizer.flats[index].master.numel()
                    target = slices[index].setdefault(kind, torch.zeros(size))
                    run = tensors.get_range(key, start - lo, end - lo)
                    target[start + shift : end + shift] = run
                    continue
                for first in range(start, end, sink.chunk):
                    last = min(first + sink.chunk, end)
                    sink.write(first + shift, tensors.get_range(key, first - lo, last - lo))
    return slices, extras


@torch.no_grad()
def load_shards(optimizer: Any, folder: str | Path) -> None:
    """Load a sharded checkpoint saved on any world size (resharding). Collective.

    Everything is read and checked before anything is loaded: a checkpoint of another model or
    optimizer, or a corrupt or incomplete one, is refused whole.
    """
    folder = Path(folder)
    metas = load_shard_files(folder)
    _check_compatible(optimizer, metas[0])
    saved_delay = metas[0].get("delayed") or {"steps": 0, "unpublished": False}
    delayed = getattr(optimizer, "delayed", None)
    if saved_delay["unpublished"] and delayed is None:
        raise CheckpointError(
            f"{folder} was saved with a delayed update (DPU) in flight: its parameters are one "
            "step behind its masters; load it into an optimizer built with delayed_update=True"
        )
    if delayed is not None:
        optimizer.wait_for_step()  # a step in flight would write over what is loaded
    saved_states = _flat_states(optimizer, metas[0])
    sinks = file_sinks(optimizer, saved_states)
    slices, extras = _read_my_runs(optimizer, folder, metas, sinks)
    stale: list[torch.Tensor] = []
    inner_state: dict[int, dict[str, Any]] = {}
    for index, (flat, kinds, saved) in enumerate(zip(optimizer.flats, slices, saved_states)):
        # A shard made only of padding reads no run at all: padding is zero in the parameters
        # and in every state (its gradient is always zero), so zeros are its exact values.
        if "param" not in sinks[index]:  # (else its file and compute copy are already loaded)
            optimizer.set_master(flat, kinds.pop("param", torch.zeros(flat.master.numel())))
        for kind in saved["kinds"]:
            if kind not in sinks[index]:
                kinds.setdefault(kind, torch.zeros(flat.master.numel()))
        if "stale" in kinds:
            stale.append(kinds.pop("stale"))
        # Each flat gets its own scalar tensors: torch's load_state_dict keeps a `step` tensor
        # as given, so one shared tensor would be advanced once per flat by every step.
        scalars = {k: _own_copy(v) for k, v in saved["scalars"].items()}
        if kinds or scalars:
            inner_state[index] = {**scalars, **kinds}
    # torch's base state_dict, for the groups' layout: NVMeAdam's own reads every moment whole.
    # It numbers the masters group by group, which need not be the flats' (bucket) order.
    inner = torch.optim.Optimizer.state_dict(optimizer.optimizer)
    held = [p for group in optimizer.optimizer.param_groups for p in group["params"]]
    number = {id(master): position for position, master in enumerate(held)}
    flats = optimizer.flats
    inner["state"] = {number[id(flats[i].master)]: value for i, value in inner_state.items()}
    for group, saved in zip(inner["param_groups"], metas[0]["param_groups"]):
        group.update(saved)
    optimizer.optimizer.load_state_dict(inner)
    for flat, mine in zip(optimizer.flats, sinks):
        if any(kind in mine for kind in MOMENTS):  # loaded into the files above
            optimizer.optimizer.moments_written(flat.master)
    optimizer.publish()  # stages 1/2: all-gather the new slices; stage 3: refresh the shards
    if delayed is not None:  # a checkpoint without DPU state (no DPU, or older): warm up anew
        delayed.steps = saved_delay["steps"]
        delayed.unpublished = saved_delay["unpublished"]
        if delayed.unpublished:  # forward goes on with the parameters of one step before
            optimizer.show_values(stale)
    plain = optimizer.module.state_dict(keep_vars=True)
    for key, value in extras.items():
        plain[key].data.copy_(value)


def _own_copy(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


def _flat_states(optimizer: Any, meta: dict[str, Any]) -> list[dict[str, Any]]:
    """Per flat of `optimizer`: the element-wise state kinds and scalar state saved for it.

    Flats are the same on every world size (they follow buckets, not ranks), so they match by
    index. A run built with other buckets has other flats: every saved flat then holds the same
    scalars (all step together), which each new flat takes.
    """
    if meta["format"] == _FORMAT_2:  # one scalar set for all flats, kinds not recorded
        return [{"kinds": [], "scalars": meta["scalars"]} for _ in optimizer.flats]
    saved = meta["flat_state"]
    if len(saved) == len(optimizer.flats):
        return saved
    if all(_same_state(entry, saved[0]) for entry in saved):
        return [saved[0] for _ in optimizer.flats]
    raise CheckpointError(
        f"the checkpoint has {len(saved)} flat shards with different optimizer state and this "
        f"optimizer {len(optimizer.flats)}: build it with the bucket size it was saved with"
    )


def _same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a["kinds"] != b["kinds"] or a["scalars"].keys() != b["scalars"].keys():
        return False
    for key, value in a["scalars"].items():
        other = b["scalars"][key]
        if isinstance(value, torch.Tensor):
            if not (isinstance(other, torch.Tensor) and torch.equal(value, other)):
                return False
        elif value != other:
            return False
    return True


def consolidate(run_dir: str | Path, out_path: str | Path) -> Path:
    """Stream a sharded checkpoint into one plain safetensors state dict; return its path.

    `run_dir` is a `tessera train` run folder (its newest verified checkpoint's state file names
    the shard folder) or a folder of shard files. Parameters are written in fp32 (the master
    weights), tied ones under each of their keys; memory is bounded by the largest tensor.
    """
    from tessera.checkpoint.series import latest_checkpoint

    run_dir, out_path = Path(run_dir), Path(out_path)
    folder = run_dir
    state_file = latest_checkpoint(run_dir)
    if state_file is not None:
        meta = load_checkpoint(state_file).get("engine", {})
        if "zero_shards" not in meta:
            raise CheckpointError(f"{state_file} is a checkpoint that is not sharded by ZeRO")
        folder = state_file.parent / meta["zero_shards"]
    metas = load_shard_files(folder)
    head = metas[0]
    with _open_verified(folder, head) as first:
        extra = {
            k: (first.dtype(f"extra|{k}|0"), first.header[f"extra|{k}|0"]["shape"])
            for k in head["extra_keys"]
        }
    entries = [
        (key, *extra[key])
        if key in extra
        else (key, torch.float32, head["shapes"][head["params"][key]])
        for key in head["keys"]
    ]
    prefix, header, total = layout(entries, {"format": "pt", "source": "tessera.zero.consolidate"})
    keys_of: dict[str, list[str]] = {}
    for key, name in head["params"].items():
        keys_of.setdefault(name, []).append(key)
    written: dict[str, int] = {}

    def fill(out: Any) -> None:
        out.write(prefix)
        out.truncate(len(prefix) + total)
        for meta in metas:
            with _open_verified(folder, meta) as tensors:
                for key in tensors.keys():
                    kind, name, first = key.split("|")
                    if kind not in ("param", "extra"):
                        continue
                    run = tensors.get(key)  # one run in memory at a time
                    targets = [name] if kind == "extra" else keys_of[name]
                    element = 4 if kind == "param" else run.element_size()
                    for target in targets:
                        out.seek(
                            len(prefix) + header[target]["data_offsets"][0] + element * int(first)
                        )
                        out.write(tensor_bytes(run))
                    if kind == "param":
                        written[name] = written.get(name, 0) + run.numel()
        for name, shape in head["shapes"].items():
            if written.get(name, 0) != torch.Size(shape).numel():
                raise CheckpointError(f"the shards do not cover parameter {name!r}")

    write_atomically(out_path, fill)
    return out_path
