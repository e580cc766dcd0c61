"""Sharded ZeRO checkpoints: one file per rank, resharding on load, consolidation to safetensors.

Each rank writes its shard with `tessera.train.checkpoint.save_checkpoint` (temporary file,
fsync, rename; SHA-256 checked on read). A shard stores, per parameter, the runs of elements the
rank owns (`partition.shard_pieces`) of the fp32 master weights and of every element-wise
optimizer state, so the files do not depend on the bucket layout or the world size:

* resume on another world size: every rank reads all shard files, reassembles each state per
  parameter and keeps its new slices (memory: the full model in fp32 per state, transiently);
* `consolidate`: streams the shards, one file at a time, into one plain safetensors file laid out
  up front, so memory is bounded by one rank's shard, never the whole model. The file loads with
  `safetensors.torch.load_file` and `nn.Module.load_state_dict`, no tessera needed.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

from tessera.errors import CheckpointError
from tessera.zero.partition import shard_pieces

__all__ = ["consolidate", "load_shard_files", "load_shard_states", "shard_state"]

FORMAT = "tessera-zero-shard/1"
_SHARD_FILE = re.compile(r"rank-(\d+)-of-(\d+)\.pt$")
_SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def shard_file_name(rank: int, world_size: int) -> str:
    """The file name of one rank's shard."""
    return f"rank-{rank:05d}-of-{world_size:05d}.pt"


def _parameter_keys(optimizer: Any) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """state_dict key -> parameter name for sharded parameters; the other tensors (buffers)."""
    module = optimizer.module
    sharded = {name for flat in optimizer.flats for name in flat.layout.names}
    names = {id(p): name for name, p in module.named_parameters()}
    params, extras = {}, {}
    for key, tensor in module.state_dict(keep_vars=True).items():
        name = names.get(id(tensor))
        if name in sharded:
            params[key] = name
        else:
            extras[key] = tensor.detach().clone()
    return params, extras


def shard_state(optimizer: Any) -> dict[str, Any]:
    """This rank's shard of a ZeRO optimizer (`ZeroStage1/2/3`) as plain tensors and data."""
    params, extras = _parameter_keys(optimizer)
    shapes = {n: list(s) for f in optimizer.flats for n, s in zip(f.layout.names, f.layout.shapes)}
    pieces: dict[str, list[tuple[str, int, torch.Tensor]]] = {"param": []}
    scalars: dict[str, Any] = {}
    for flat in optimizer.flats:
        sources = {"param": flat.master.detach()}
        for kind, value in optimizer.optimizer.state.get(flat.master, {}).items():
            if isinstance(value, torch.Tensor) and value.shape == flat.master.shape:
                sources[kind] = value
            else:
                scalars[kind] = value  # e.g. Adam's step count: the same for every shard
        for piece in shard_pieces(flat.layout, optimizer.world, optimizer.rank):
            end = piece.shard_lo + piece.param_hi - piece.param_lo
            for kind, source in sources.items():
                run = source[piece.shard_lo : end].detach().float().clone()
                pieces.setdefault(kind, []).append((piece.name, piece.param_lo, run))
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return {
        "format": FORMAT,
        "stage": optimizer.stage,
        "rank": optimizer.rank,
        "world_size": optimizer.world,
        "keys": list(params) + [k for k in extras if k not in params],
        "params": params,
        "shapes": shapes,
        "extras": extras if optimizer.rank == 0 else {},
        "pieces": pieces,
        "scalars": scalars,
        "param_groups": groups,
    }


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """`tessera.train.checkpoint.load_checkpoint` (imported late: tessera.train imports ZeRO)."""
    from tessera.train.checkpoint import load_checkpoint as load_verified

    return load_verified(path)


def load_shard_files(folder: str | Path) -> list[dict[str, Any]]:
    """Every rank's shard in `folder`, in rank order; refuses an incomplete or mixed set."""
    folder = Path(folder)
    found = {}
    for path in folder.glob("rank-*-of-*.pt"):
        match = _SHARD_FILE.search(path.name)
        if match:
            found[(int(match[1]), int(match[2]))] = path
    worlds = {world for _, world in found}
    if len(worlds) != 1:
        raise CheckpointError(f"{folder}: expected the shards of one world size, found {worlds}")
    world = worlds.pop()
    missing = [r for r in range(world) if (r, world) not in found]
    if missing:
        raise CheckpointError(f"{folder}: shard files of ranks {missing} (of {world}) are missing")
    return [load_checkpoint(found[(r, world)]) for r in range(world)]


def _check_compatible(optimizer: Any, states: list[dict[str, Any]]) -> None:
    if not states or any(s.get("format") != FORMAT for s in states):
        raise CheckpointError("not a tessera ZeRO shard checkpoint")
    ours = {n: list(s) for f in optimizer.flats for n, s in zip(f.layout.names, f.layout.shapes)}
    theirs = states[0]["shapes"]
    for name in sorted(set(ours) | set(theirs)):
        if ours.get(name) != theirs.get(name):
            raise CheckpointError(
                f"checkpoint is from another model: parameter {name!r} has shape "
                f"{theirs.get(name)} in the checkpoint and {ours.get(name)} in this model"
            )
    _, extras = _parameter_keys(optimizer)
    for key in sorted(set(extras) ^ set(states[0]["extras"])):
        raise CheckpointError(f"checkpoint is from another model: buffer {key!r} differs")
    saved_options = set(states[0]["param_groups"][0]) if states[0]["param_groups"] else set()
    our_options = {k for k in optimizer.param_groups[0] if k != "params"}
    if saved_options != our_options:
        raise CheckpointError(
            f"checkpoint is from another optimizer: options {sorted(saved_options ^ our_options)}"
        )


def _assemble(states: list[dict[str, Any]]) -> dict[str, dict[str, torch.Tensor]]:
    """kind -> parameter name -> flat fp32 tensor, from every rank's pieces."""
    shapes = states[0]["shapes"]
    full: dict[str, dict[str, torch.Tensor]] = {}
    filled: dict[tuple[str, str], int] = {}
    for state in states:
        for kind, runs in state["pieces"].items():
            for name, lo, run in runs:
                numel = int(torch.Size(shapes[name]).numel())
                target = full.setdefault(kind, {}).setdefault(name, torch.zeros(numel))
                target[lo : lo + run.numel()] = run
                filled[(kind, name)] = filled.get((kind, name), 0) + run.numel()
    for (kind, name), count in filled.items():
        if count != torch.Size(shapes[name]).numel():
            raise CheckpointError(f"shards cover {count} elements of {name!r} ({kind})")
    return full


@torch.no_grad()
def load_shard_states(optimizer: Any, states: list[dict[str, Any]]) -> None:
    """Load shards saved on any world size into `optimizer` and its module (resharding).

    Everything is checked before anything is loaded: another model or optimizer is refused.
    """
    _check_compatible(optimizer, states)
    full = _assemble(states)
    inner_state: dict[int, dict[str, Any]] = {}
    for index, flat in enumerate(optimizer.flats):
        per_kind = {kind: torch.zeros_like(flat.master, dtype=torch.float32) for kind in full}
        for piece in shard_pieces(flat.layout, optimizer.world, optimizer.rank):
            end = piece.shard_lo + piece.param_hi - piece.param_lo
            for kind, target in per_kind.items():
                target[piece.shard_lo : end] = full[kind][piece.name][
                    piece.param_lo : piece.param_hi
                ]
        flat.master.copy_(per_kind.pop("param"))
        if per_kind:
            inner_state[index] = {**per_kind, **states[0]["scalars"]}
    inner = optimizer.optimizer.state_dict()
    inner["state"] = inner_state
    for group, saved in zip(inner["param_groups"], states[0]["param_groups"]):
        group.update(saved)
    optimizer.optimizer.load_state_dict(inner)
    if optimizer.stage < 3:  # replicated parameters: write every element locally, no collective
        for flat in optimizer.flats:
            offsets = flat.layout.offsets
            for position, name in enumerate(flat.layout.names):
                flat.flat_param[offsets[position] : offsets[position + 1]] = full["param"][name]
    else:
        optimizer._publish()
    plain = optimizer.module.state_dict(keep_vars=True)
    for key, value in states[0]["extras"].items():
        plain[key].data.copy_(value)


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def consolidate(run_dir: str | Path, out_path: str | Path) -> Path:
    """Stream a sharded checkpoint into one plain safetensors state dict; return its path.

    `run_dir` is a `tessera train` run folder (its checkpoint.pt names the shard folder) or a
    folder of `rank-*-of-*.pt` files. Parameters are written in fp32 (the master weights).
    """
    run_dir, out_path = Path(run_dir), Path(out_path)
    folder = run_dir
    if (run_dir / "checkpoint.pt").is_file():
        meta = load_checkpoint(run_dir / "checkpoint.pt").get("engine", {})
        if "zero_shards" not in meta:
            raise CheckpointError(f"{run_dir} holds a checkpoint that is not sharded by ZeRO")
        folder = run_dir / meta["zero_shards"]
    paths = sorted(folder.glob("rank-*-of-*.pt"))
    if not paths:
        raise CheckpointError(f"no ZeRO shard files (rank-*-of-*.pt) in {folder}")
    head = load_checkpoint(paths[0])
    if head.get("format") != FORMAT or head["rank"] != 0:
        raise CheckpointError(f"{paths[0]} is not rank 0's ZeRO shard")
    world = head["world_size"]
    if len(paths) != world:
        raise CheckpointError(f"{folder}: {len(paths)} shard files for a world of {world}")
    header: dict[str, Any] = {}
    offset = 0
    for key in head["keys"]:
        if key in head["extras"]:
            tensor = head["extras"][key]
            dtype, shape = tensor.dtype, list(tensor.shape)
        else:
            dtype, shape = torch.float32, head["shapes"][head["params"][key]]
        nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        header[key] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": shape,
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    header["__metadata__"] = {"format": "pt", "source": "tessera.zero.consolidate"}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    base = 8 + len(encoded)
    keys_of: dict[str, list[str]] = {}
    for key, name in head["params"].items():
        keys_of.setdefault(name, []).append(key)
    written: dict[str, int] = {}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out_path.name}.", dir=out_path.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(len(encoded).to_bytes(8, "little") + encoded)
            out.truncate(base + offset)
            for key, tensor in head["extras"].items():
                out.seek(base + header[key]["data_offsets"][0])
                out.write(_tensor_bytes(tensor))
            for rank, path in enumerate(paths):
                shard = head if rank == 0 else load_checkpoint(path)
                if shard.get("rank") != rank or shard.get("world_size") != world:
                    raise CheckpointError(f"{path} is not shard {rank} of {world}")
                for name, lo, run in shard["pieces"]["param"]:
                    written[name] = written.get(name, 0) + run.numel()
                    for key in keys_of[name]:
                        out.seek(base + header[key]["data_offsets"][0] + 4 * lo)
                        out.write(_tensor_bytes(run.float()))
                del shard
                head["pieces"] = {}  # rank 0's runs are written: keep one shard in memory
            out.flush()
            os.fsync(out.fileno())
        for name, shape in head["shapes"].items():
            if written.get(name, 0) != torch.Size(shape).numel():
                raise CheckpointError(f"the shards do not cover parameter {name!r}")
        os.replace(tmp_name, out_path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return out_path
