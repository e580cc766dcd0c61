"""The shared-memory transport: how ranks of one host move bytes without a socket.

One module per piece, from the bottom up:
- `files`: the files in /dev/shm (unguessable names, exclusive creation, cleanup on any exit);
- `atomics`: sequentially consistent loads, stores and adds on shared words (libatomic);
- `futex`: sleeping on a shared word until a peer changes it (Linux futex(2));
- `segments`: a group's mapped segments and the probe that decides who shares memory;
- `group`: `ShmGroup`, the group's barrier, all-reduce and broadcast in place;
- `gather`: all-gather and reduce-scatter, double-buffered, one barrier per call;
- `channel`: `Endpoint`, a point-to-point ring of slots per pipeline link.

The algorithms and the api (`tessera.comm`) choose this transport where the probe found every
rank of a group able to share memory, and fall back to messages otherwise.
"""

from tessera.comm.shm.channel import Endpoint, ring_available
from tessera.comm.shm.group import ShmGroup, shm_group

__all__ = ["Endpoint", "ShmGroup", "ring_available", "shm_group"]
