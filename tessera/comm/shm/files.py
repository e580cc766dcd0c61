"""The files behind shared memory: unguessable names, exclusive creation, cleanup on any exit.

/dev/shm is one directory shared by every user and container of the host, so each file is made
so that nobody else can interfere with it:

- Names are `tessera-<pid namespace>-<pid>-<128 random bits>.<kind>`, drawn with `secrets`
  for every file (never derived from an earlier name), and published to the peers only after
  the file exists: another user cannot guess the next name to pre-create it. A name that
  exists anyway (pre-created, or a collision) is skipped and another drawn; the stranger's file
  is left alone.
- Files are created with O_CREAT | O_EXCL | O_NOFOLLOW and mode 0600, and a peer opening one
  checks that it belongs to our uid and has the expected type, so a look-alike planted by
  another user is refused.
- Files live in /dev/shm only while the group sets up (every rank maps them, then the creator
  unlinks them; the memory lives on in the mappings). Past that window nothing can leak, and
  within it: `atexit` unlinks our files on a normal exit, a SIGTERM handler (chained to the
  previous one) unlinks them when the launcher stops the job, and `sweep_stale` removes the
  files of dead processes (SIGKILL, a crash) when the next group sets up. The SIGTERM handler
  is Python's, so it runs when the main thread next executes Python code: at once in tessera's
  own waits, after a blocking torch.distributed call returns (which it does when the peers,
  terminated too, close their connections). The pid namespace in the name keeps a sweep from
  judging the pids of another container's processes.

`SHM_DIR` is read at every call: tests point one rank elsewhere to play a rank on another host.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import secrets
import stat

from tessera.runtime.signals import on_sigterm

__all__ = [
    "SHM_DIR",
    "create_fifo",
    "create_file",
    "install_sigterm_cleanup",
    "open_checked",
    "sweep_stale",
    "unlink",
]

SHM_DIR = "/dev/shm"
"""Where the files go; a tmpfs shared by the processes of one host (and of one container)."""

_NAME = re.compile(r"^tessera-(\d+)-(\d+)-([0-9a-f]{32})\.(control|seg|pipe)$")
_TRIES = 16  # fresh names tried before giving up (a collision of 128 random bits: never)

_created: dict[str, str] = {}  # name -> path of the files we created and have not unlinked


def _pid_namespace() -> int:
    """The inode of this process's pid namespace (0 where /proc does not tell)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _path(name: str) -> str:
    if not _NAME.match(name):  # names come from peers: never a path, never another prefix
        raise ValueError(f"not a tessera shared-memory name: {name!r}")
    return os.path.join(SHM_DIR, name)


def _new_name(kind: str) -> str:
    return f"tessera-{_pid_namespace()}-{os.getpid()}-{secrets.token_hex(16)}.{kind}"


def create_file(kind: str, size: int) -> tuple[str, int]:
    """A new file of `size` bytes with a fresh name: (name, open read-write descriptor)."""
    for _ in range(_TRIES):
        name = _new_name(kind)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        try:
            fd = os.open(_path(name), flags, 0o600)
        except FileExistsError:
            continue  # someone else's file: leave it and draw another name
        _created[name] = _path(name)
        try:
            os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            unlink(name)
            raise
        return name, fd
    raise FileExistsError(f"{_TRIES} fresh names for a shared-memory {kind} all existed")


def create_fifo(kind: str = "pipe") -> str:
    """A new named pipe (mode 0600) with a fresh name; returns the name."""
    for _ in range(_TRIES):
        name = _new_name(kind)
        try:
            os.mkfifo(_path(name), 0o600)
        except FileExistsError:
            continue
        _created[name] = _path(name)
        return name
    raise FileExistsError(f"{_TRIES} fresh names for a named pipe all existed")


def open_checked(name: str, flags: int, fifo: bool) -> int:
    """Open a peer's file, refusing one of another user or of the wrong type."""
    fd = os.open(_path(name), flags | os.O_NOFOLLOW)
    info = os.fstat(fd)
    right_type = stat.S_ISFIFO(info.st_mode) if fifo else stat.S_ISREG(info.st_mode)
    if info.st_uid != os.getuid() or not right_type or info.st_mode & 0o077:
        os.close(fd)
        raise PermissionError(f"{name}: not a private {'pipe' if fifo else 'file'} of our uid")
    return fd


def unlink(name: str) -> None:
    """Remove one of our files (already gone: fine)."""
    path = _created.pop(name, None) or _path(name)
    with contextlib.suppress(OSError):
        os.unlink(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, belongs to another user
        return True
    return True


def sweep_stale() -> list[str]:
    """Unlink the files left by dead processes of our uid and pid namespace; return their names.

    A process killed while its group set up leaves its files behind; they hold memory until
    removed. Only files whose creator is provably gone are touched: same pid namespace (a pid
    means nothing in another one), pid not alive, owned by us.
    """
    namespace, removed = _pid_namespace(), []
    try:
        entries = list(os.scandir(SHM_DIR))
    except OSError:
        return removed
    for entry in entries:
        match = _NAME.match(entry.name)
        if not match or int(match.group(1)) != namespace or int(match.group(2)) == os.getpid():
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
        except OSError:
            continue
        if not _alive(int(match.group(2))):
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
                removed.append(entry.name)
    return removed


@atexit.register
def _cleanup() -> None:
    for name in list(_created):
        unlink(name)


def install_sigterm_cleanup() -> None:
    """Unlink our files on SIGTERM, then do what the previous handler did (idempotent;
    `tessera.runtime.signals`)."""
    on_sigterm(_cleanup)
