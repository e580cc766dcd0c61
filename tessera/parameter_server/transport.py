"""Calls between parameter-server processes: `torch.distributed.rpc` (TensorPipe), tagged with a
run token.

PyTorch's RPC framework was built for the parameter-server paradigm: a worker calls a function on
a server process and gets tensors back, many calls in flight at once, each served on a thread of
the server's pool (so a pull that must wait for a straggler blocks one thread, not the server).
This module is the whole dependency on it: `Transport.call_async(rank, method, *args)` runs
`method` on the object the process at `rank` registered with `serve`, and returns a future.

Trust model: the RPC world is a trusted network, as PyTorch documents for `torch.distributed.rpc`.
Any process of the world can call any importable function on any other (`rpc.rpc_sync("server-0",
os.getpid)` works without going through this module), TensorPipe unpickles a call's arguments
before any code of ours runs, and its traffic is neither authenticated nor encrypted. So a peer
in the world can run code on a server, read the parameters or change them, token or not; tessera
has no security boundary here. What narrows the world: `run` spawning locally binds TensorPipe to
loopback (no other machine can connect; a process of this machine can) and puts the rendezvous
file in a folder only this user can read; under torchrun the world is whoever the launcher admits,
so run it on a network you trust.

The token is a guard against mixed-up jobs, not against attackers: every call made through this
module carries the caller's token, and the receiving side compares it with its own (bytes, in
constant time) before touching the served object. A worker of another run (another token) that
joined this rendezvous by mistake gets `PeerRefused` on its first call, is logged through the
served object's `on_refused`, is never served, and is dropped by the servers as silent; the run
goes on.

Every wait is bounded: each call by `rpc_timeout_s`, and a timed-out or broken call raises
`PSTimeout` naming the peer and the operation.

Errors keep their type across the wire: RPC's futures turn any remote exception into a
`RuntimeError`, so a tessera error raised by the served object travels back as a `_Failure` value
and is raised again, as itself, on the caller.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed.rpc as rpc
from torch.futures import Future

from tessera.errors import ConfigError, TesseraError
from tessera.parameter_server.errors import GradientShapeError, PeerRefused, PSTimeout, WorkerLost

__all__ = ["Transport", "peer_name", "serve"]

_SERVED: Any = None  # the object this process serves; one per process, set by `serve`
_TOKEN: str = ""


def peer_name(rank: int, num_servers: int) -> str:
    """`server-S` for the first S ranks, `worker-W` for the others: the names errors use."""
    return f"server-{rank}" if rank < num_servers else f"worker-{rank - num_servers}"


def serve(obj: Any) -> None:
    """Make `obj`'s public methods callable through `Transport.call` by peers presenting this run's
    token (a guard against a worker of another run, not access control: see the module note)."""
    global _SERVED
    _SERVED = obj


@dataclass(frozen=True)
class _Failure:
    """A tessera error raised by the served object, sent back as a value to keep its type."""

    type_name: str
    message: str


_ERRORS_BY_NAME = {
    cls.__name__: cls
    for cls in (ConfigError, GradientShapeError, PeerRefused, PSTimeout, WorkerLost)
}


def _dispatch(method: str, caller: str, token: str, args: tuple) -> Any:
    """Runs on the callee: check the run token, then call `method` on the served object."""
    try:
        return _checked_call(method, caller, token, args)
    except TesseraError as exc:
        if type(exc).__name__ not in _ERRORS_BY_NAME:
            raise
        return _Failure(type(exc).__name__, str(exc))


def _checked_call(method: str, caller: str, token: str, args: tuple) -> Any:
    served = _SERVED
    if served is None:
        raise RuntimeError(f"{caller} called {method} on a process that serves nothing")
    if not hmac.compare_digest(token.encode(), _TOKEN.encode()):
        if hasattr(served, "on_refused"):
            served.on_refused(caller, method)
        raise PeerRefused(f"{caller} refused for {method}: wrong or missing token")
    if method.startswith("_") or not callable(getattr(served, method, None)):
        raise AttributeError(f"{caller} called unknown method {method!r}")
    return getattr(served, method)(*args)


class Transport:
    """This process's RPC endpoint in a world of `world_size` named peers."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        num_servers: int,
        init_method: str,
        token: str,
        rpc_timeout_s: float,
    ) -> None:
        global _TOKEN
        _TOKEN = token
        self.rank = rank
        self.name = peer_name(rank, num_servers)
        self.num_servers = num_servers
        self.token = token
        self.rpc_timeout_s = rpc_timeout_s
        options = rpc.TensorPipeRpcBackendOptions(
            init_method=init_method,
            rpc_timeout=rpc_timeout_s,
            # A pull waiting for a straggler holds a thread: one per worker, plus margin.
            num_worker_threads=max(16, 2 * world_size + 4),
        )
        rpc.init_rpc(self.name, rank=rank, world_size=world_size, rpc_backend_options=options)
        self._names = {r: peer_name(r, num_servers) for r in range(world_size)}

    def call_async(self, rank: int, method: str, *args: Any) -> Future:
        """Start `method(*args)` on the process at `rank`; a future of its result."""
        return rpc.rpc_async(
            self._names[rank],
            _dispatch,
            args=(method, self.name, self.token, args),
            timeout=self.rpc_timeout_s,
        )

    def call(self, rank: int, method: str, *args: Any) -> Any:
        """`call_async(...)` and wait for it."""
        return self.wait([(rank, method, self.call_async(rank, method, *args))])[0]

    def wait(self, calls: Sequence[tuple[int, str, Future]]) -> list[Any]:
        """Results of `(rank, method, future)` calls in flight, in order; errors name the peer."""
        results = []
        for rank, method, future in calls:
            try:
                value = future.wait()
            except Exception as exc:  # noqa: BLE001 - RPC re-raises remote errors as their type
                text = str(exc)
                if "timed out" in text.lower() or "timeout" in text.lower():
                    raise PSTimeout(
                        f"{self.name}: {method} on {self._names[rank]} did not complete within "
                        f"{self.rpc_timeout_s:g} s"
                    ) from exc
                raise
            if isinstance(value, _Failure):
                raise _ERRORS_BY_NAME[value.type_name](value.message)
            results.append(value)
        return results

    def shutdown(self) -> None:
        """Leave the RPC world without a barrier: a dropped worker must not hold the others."""
        rpc.shutdown(graceful=False)
