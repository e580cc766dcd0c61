"""Who shares keys and masks with whom in a secure-aggregation round.

Bonawitz et al. 2017 use the complete graph: every client agrees keys, masks and shares secrets
with every other one, so a client's cost grows linearly with the round's size. SecAgg+ (Bell,
Bonawitz, Gascon, Lepoint, Raykova, "Secure Single-Server Aggregation with (Poly)Logarithmic
Overhead", CCS 2020) lets the server draw, each round, a random k-regular graph and runs the same
protocol along its edges only. Like Bell et al. (and Flower's SecAgg+) the graph here is a Harary
graph H(k, n) over a random ordering of the clients: place them on a ring in random order and
join each to the k/2 nearest on either side (for odd k with even n, also to the opposite one).
H(k, n) is k-regular and k-vertex-connected (Harary 1962): removing fewer than k clients cannot
split the others into groups whose partial sums the server could unmask separately.

The graph must be symmetric: the mask u adds for edge {u, v} cancels only against the one v
subtracts for the same edge.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np


def degree(neighbours: int | None, count: int) -> int:
    """The degree the graph over `count` clients has: `neighbours` (None: complete graph) capped
    at count - 1, and rounded up to even when `count` is odd, since no graph on an odd number of
    vertices has an odd degree everywhere."""
    if neighbours is None or neighbours >= count - 1:
        return count - 1
    return neighbours + 1 if neighbours % 2 and count % 2 else neighbours


def harary_graph(
    clients: Sequence[int], neighbours: int | None, rng: np.random.Generator
) -> dict[int, frozenset[int]]:
    """`{u: u's neighbours}` for a random-order Harary graph of degree `degree(neighbours, n)`."""
    count = len(clients)
    k = degree(neighbours, count)
    if k == count - 1:
        return {u: frozenset(v for v in clients if v != u) for u in clients}
    ring = [clients[i] for i in rng.permutation(count)]
    offsets = list(range(1, k // 2 + 1)) + ([count // 2] if k % 2 else [])
    graph: dict[int, set[int]] = {u: set() for u in clients}
    for position, u in enumerate(ring):
        for offset in offsets:  # each edge is entered from both ends: the graph is symmetric
            v = ring[(position + offset) % count]
            graph[u].add(v)
            graph[v].add(u)
    return {u: frozenset(vs) for u, vs in graph.items()}


def components(graph: Mapping[int, frozenset[int]], alive: set[int]) -> list[list[int]]:
    """The connected components of the graph restricted to `alive`, each sorted, by first id."""
    groups, seen = [], set()
    for start in sorted(alive):
        if start in seen:
            continue
        seen.add(start)
        group, frontier = [start], [start]
        while frontier:
            frontier = [v for u in frontier for v in graph[u] & alive if v not in seen]
            frontier = sorted(set(frontier))
            seen.update(frontier)
            group.extend(frontier)
        groups.append(sorted(group))
    return groups
