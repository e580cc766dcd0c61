"""The checkpoints of a run folder: one folder per saved step, complete or absent, never half.

Layout (`tessera train` run folder):

    checkpoints/
      step-00000050/          complete: renamed into place after every file was written
        state.pt              step, engine state (or the ZeRO shard index), every rank's RNG
        zero/rank-R-of-W.*    ZeRO strategies: one shard per rank (`tessera.zero.checkpoint`)
        manifest.json         size and SHA-256 of every other file, the step, the world size
      .step-00000100.partial/ a save in progress (or killed): never read, removed by the next save

A save writes everything into the `.partial` folder, then rank 0 hashes nothing twice: every rank
hashes a share of the files (`hash_share`), rank 0 writes `manifest.json` atomically and renames
the folder to `step-N` (a rename is atomic on POSIX; the parent folder is fsync'ed). So a folder
named `step-N` with a manifest is complete, whatever moment a `kill -9` hit. Older checkpoints
are deleted only after that rename (`prune`), keeping the newest `keep` that verify: a folder that
fails verification is not counted, so it never costs a good checkpoint its place.

Reading (`latest_checkpoint`) takes the newest complete checkpoint whose files all match their
manifest; one that fails (a truncated or flipped file) is skipped with a warning naming the file,
and the previous one is used. Run folders of older tessera versions hold one `checkpoint.pt`
beside config.yaml: it is still read, after every checkpoint of the new layout, and deleted only
once `keep` verified checkpoints of the new layout exist.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, BinaryIO

from tessera.checkpoint.atomic import fsync_folder, pause_point, write_atomically
from tessera.errors import CheckpointError

__all__ = [
    "CHECKPOINTS_DIR",
    "LEGACY_CHECKPOINT",
    "MANIFEST_FILE",
    "STATE_FILE",
    "begin_save",
    "checkpoint_step",
    "clean_stale",
    "commit",
    "complete_checkpoints",
    "has_checkpoint",
    "has_verified_checkpoint",
    "hash_share",
    "latest_checkpoint",
    "partial_folder",
    "prune",
    "read_manifest",
    "step_folder",
    "verify",
]

CHECKPOINTS_DIR = "checkpoints"
STATE_FILE = "state.pt"
MANIFEST_FILE = "manifest.json"
LEGACY_CHECKPOINT = "checkpoint.pt"
"""The single, overwritten checkpoint of run folders written before the per-step layout."""
_LEGACY_SHARDS = "zero"
"""Where the legacy layout kept ZeRO shard folders (`zero/step-N/`), beside checkpoint.pt."""
FORMAT = "tessera-checkpoint/1"
_STEP = re.compile(r"step-(\d+)$")
_CHUNK = 1 << 20
_verified: dict[str, tuple[tuple[str, int, int, int], ...]] = {}
"""Folders this process verified (or committed), with the stat of their files at that moment:
`prune` re-hashes a checkpoint only when one of its files changed since."""


def _signature(folder: Path) -> tuple[tuple[str, int, int, int], ...]:
    """Name, size, mtime and inode of every file of `folder` (a changed file changes one)."""
    entries = []
    for path in folder.rglob("*"):
        if path.is_file():
            stat = path.stat()
            name = path.relative_to(folder).as_posix()
            entries.append((name, stat.st_size, stat.st_mtime_ns, stat.st_ino))
    return tuple(sorted(entries))


def step_folder(run_dir: str | Path, step: int) -> Path:
    """Where the complete checkpoint of `step` lives."""
    return Path(run_dir) / CHECKPOINTS_DIR / f"step-{step:08d}"


def partial_folder(run_dir: str | Path, step: int) -> Path:
    """Where the checkpoint of `step` is written before it is complete."""
    return Path(run_dir) / CHECKPOINTS_DIR / f".step-{step:08d}.partial"


def checkpoint_step(path: str | Path) -> int:
    """The step of a checkpoint: its state file, its folder, or a legacy `checkpoint.pt`."""
    path = Path(path)
    for part in (path.name, path.parent.name):
        if match := _STEP.fullmatch(part):
            return int(match[1])
    from tessera.checkpoint.files import load_checkpoint  # legacy file: the step is inside

    return int(load_checkpoint(path)["step"])


# ------------------------------------------------------------------------------------ writing
def begin_save(run_dir: str | Path, step: int) -> Path:
    """Rank 0, before a save: clear what killed saves left, make a fresh partial folder."""
    clean_stale(run_dir)
    partial = partial_folder(run_dir, step)
    partial.mkdir(parents=True)
    return partial


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _files(folder: Path) -> list[str]:
    """Every regular file under `folder` but the manifest, as sorted relative POSIX paths."""
    names = [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()]
    return sorted(n for n in names if n != MANIFEST_FILE)


def hash_share(folder: str | Path, rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    """Size and SHA-256 of this rank's share of the files in `folder` (every world_size-th).

    Sharing the hashing keeps a save's extra reading at one pass over the checkpoint, spread
    over the ranks, instead of rank 0 reading every shard.
    """
    folder = Path(folder)
    return {
        name: {"bytes": (folder / name).stat().st_size, "sha256": _sha256(folder / name)}
        for name in _files(folder)[rank::world_size]
    }


def commit(partial: Path, step: int, files: dict[str, dict[str, Any]], **about: Any) -> Path:
    """Rank 0, once every file is written: write the manifest, rename the folder into place.

    `files` is the union of every rank's `hash_share`; `about` adds plain facts to the manifest
    (world size, strategy) that a launcher reads without loading the state. Returns the folder.
    """
    missing = sorted(set(_files(partial)) - set(files))
    if missing:
        raise CheckpointError(f"{partial}: files {missing} were written but not hashed")
    manifest = {"format": FORMAT, "step": step, **about, "files": files}
    text = json.dumps(manifest, indent=1, sort_keys=True).encode()

    def fill(file: BinaryIO) -> None:
        file.write(text)

    write_atomically(partial / MANIFEST_FILE, fill)
    for folder in [partial, *(p for p in partial.rglob("*") if p.is_dir())]:
        fsync_folder(folder)  # every file's directory entry is durable before the rename
    target = step_folder(partial.parent.parent, step)
    pause_point(f"commit:{target}")
    aside = target.parent / f".{target.name}.old"
    if target.exists():  # a resumed run saving a step again (the old one failed its checksum)
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(target, aside)  # POSIX renames no folder over a non-empty one
    os.replace(partial, target)
    fsync_folder(target.parent)
    shutil.rmtree(aside, ignore_errors=True)
    # The manifest's hashes were read from these very files: they verify as of now.
    _verified[os.path.abspath(target)] = _signature(target)
    return target


def prune(run_dir: str | Path, keep: int) -> list[Path]:
    """Keep the newest `keep` checkpoints that verify, delete older ones; return what went.

    Call only after the newest one is committed: until then the older ones are what a resume
    would use. A folder that fails verification (a corrupt `step-N` left by an earlier run, newer
    than the one just committed) does not count towards `keep` and is left where it is: a resume
    skips it with a warning, and saving its step again replaces it. Every complete checkpoint
    older than the oldest kept one goes, verified or not. A legacy `checkpoint.pt` (and its
    `zero/` shards) goes once `keep` verified checkpoints of the per-step layout exist; with fewer,
    nothing is deleted that a resume could still need.
    """
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    kept: list[Path] = []
    doomed: list[Path] = []
    for folder in complete_checkpoints(run_dir):  # newest first
        if len(kept) == keep:
            doomed.append(folder)
        elif _verifies(folder):
            kept.append(folder)
    for folder in doomed:
        # Renamed first, so a kill midway leaves a dotted folder the next save clears, never a
        # `step-N` folder with some files gone.
        aside = folder.parent / f".{folder.name}.old"
        os.replace(folder, aside)
        _verified.pop(os.path.abspath(folder), None)
        shutil.rmtree(aside, ignore_errors=True)
    legacy = Path(run_dir) / LEGACY_CHECKPOINT
    if len(kept) == keep and legacy.is_file():  # older than any of the `keep` kept
        doomed.append(legacy)
        legacy.unlink()  # first: it names the shard folder below
        shutil.rmtree(Path(run_dir) / _LEGACY_SHARDS, ignore_errors=True)
    return doomed


def _verifies(folder: Path) -> bool:
    """Whether `folder` verifies; hashed again only if a file changed since it last did."""
    known = _verified.get(os.path.abspath(folder))
    if known is not None and known == _signature(folder):
        return True
    try:
        verify(folder)
    except CheckpointError:
        return False
    return True


def clean_stale(run_dir: str | Path) -> None:
    """Remove the partial folders and temporary files that killed saves left behind."""
    run_dir = Path(run_dir)
    root = run_dir / CHECKPOINTS_DIR
    for leftover in root.glob(".*") if root.is_dir() else []:
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            leftover.unlink(missing_ok=True)
    for temporary in run_dir.glob(f".{LEGACY_CHECKPOINT}.*.tmp"):  # the legacy layout's
        temporary.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------ reading
def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Folders of committed checkpoints (named `step-N`, holding a manifest), newest first.

    Their files are not verified here: `verify` does that.
    """
    root = Path(run_dir) / CHECKPOINTS_DIR
    found = []
    for folder in root.iterdir() if root.is_dir() else []:
        match = _STEP.fullmatch(folder.name)
        if match and (folder / MANIFEST_FILE).is_file():
            found.append((int(match[1]), folder))
    return [folder for _, folder in sorted(found, reverse=True)]


def has_checkpoint(run_dir: str | Path) -> bool:
    """Whether the run folder holds a checkpoint to resume (cheap: nothing is hashed)."""
    return bool(complete_checkpoints(run_dir)) or (Path(run_dir) / LEGACY_CHECKPOINT).is_file()


def has_verified_checkpoint(run_dir: str | Path) -> bool:
    """Whether a resume of the run folder would find a checkpoint: one that verifies.

    Hashes checkpoints newest first until one verifies (each failure warns, as a resume does).
    A legacy `checkpoint.pt` counts as found: its header checksum is checked when it is loaded.
    """
    return latest_checkpoint(run_dir) is not None


def read_manifest(folder: str | Path) -> dict[str, Any]:
    """The manifest of a checkpoint folder (a CheckpointError naming it if unreadable)."""
    path = Path(folder) / MANIFEST_FILE
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} cannot be read: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a tessera checkpoint manifest ({FORMAT})")
    return manifest


def verify(folder: str | Path) -> dict[str, Any]:
    """Check every file of a checkpoint folder against its manifest; return the manifest.

    Raises CheckpointError naming the first file that is missing, of the wrong size, or whose
    SHA-256 differs, and any file present but not listed (a checkpoint is exactly its manifest).
    """
    folder = Path(folder)
    signature = _signature(folder)  # before hashing: a file changed meanwhile is hashed again
    manifest = read_manifest(folder)
    files = manifest["files"]
    for name, expected in sorted(files.items()):
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{path} is missing")
        size = path.stat().st_size
        if size != expected["bytes"]:
            state = "truncated" if size < expected["bytes"] else "longer than written"
            raise CheckpointError(
                f"{path} is {state}: {size} bytes, the manifest says {expected['bytes']}"
            )
        if _sha256(path) != expected["sha256"]:
            raise CheckpointError(f"{path} is corrupt: checksum mismatch")
    extra = sorted(set(_files(folder)) - set(files))
    if extra:
        raise CheckpointError(f"{folder} holds files its manifest does not list: {extra}")
    _verified[os.path.abspath(folder)] = signature
    return manifest


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The state file of the newest complete, verified checkpoint of a run folder, or None.

    This is what a resume (`--resume DIR`, or a supervisor restarting failed ranks) loads. A
    checkpoint failing verification is skipped with a `RuntimeWarning` naming the bad file, and
    the previous one is tried. A legacy `checkpoint.pt` (older run folders, and the parameter
    server's) comes last; a headed one of older versions has its checksum verified on load.
    """
    run_dir = Path(run_dir)
    for folder in complete_checkpoints(run_dir):
        try:
            verify(folder)
        except CheckpointError as exc:
            warnings.warn(
                f"skipping checkpoint {folder.name}: {exc}; using the previous one",
                RuntimeWarning,
                stacklevel=2,
            )
            continue
        return folder / STATE_FILE
    legacy = run_dir / LEGACY_CHECKPOINT
    return legacy if legacy.is_file() else None
