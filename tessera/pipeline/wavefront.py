"""Wavefront parallelism for stacked RNNs: one layer per rank, time steps streamed through.

A stacked LSTM's layer k at step t needs layer k-1's output at step t and its own state at t-1.
With layer k on rank k, rank k computes step t as soon as rank k-1 sends `h_{k-1,t}`, so after
L-1 steps of filling every rank is busy: layer k on step t while layer k+1 is on step t-1 (the
diagonal "wavefront" of the (layer, time) grid). Forward takes T + L - 1 cell times instead of
T L; backward runs the same wave in reverse time: rank k+1 back-propagates step t, sends
dL/dh_{k,t} down, and rank k adds the recurrent gradient from its step t+1. Each boundary moves
T messages of (B, H) each way. This is the pipelining of the GNMT-era multi-GPU RNNs (Wu et al.
2016, "Google's Neural Machine Translation System", section 3) and of the seed's RNN split.

Every rank calls the module with the same input (only rank 0 reads it) and gets the whole output
sequence (broadcast from the last layer), so a loss computed on every rank back-propagates
correctly; gradients reach this rank's layer parameters (shared with the user's `nn.LSTM`: no
copies), the input and the initial state `hx` if given (every layer's, gathered). The final
states `(h_n, c_n)` are returned without gradient.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call

from tessera.pipeline.links import Links
from tessera.pipeline.timeline import Event
from tessera.runtime.context import default_timeout_s

__all__ = ["WavefrontRNN", "wavefront"]

_PARAM_NAMES = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")


class _Wavefront(torch.autograd.Function):
    """Forward: the wave of cell steps over the ranks; backward: the reverse-time wave."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, rnn: WavefrontRNN, num_hx: int, *tensors: torch.Tensor
    ) -> torch.Tensor:
        """`tensors`: the `num_hx` initial states `(L, B, H)` given (0: zeros), then the
        layer's parameters."""
        hx, params = tensors[:num_hx], tensors[num_hx:]
        leaves = [p.detach().requires_grad_() for p in params]  # per-layer grads accumulate here
        k, num_layers, links = rnn.layer, rnn.num_layers, rnn.links
        steps, sends = [], []
        T, B = x.shape[0], x.shape[1]
        if hx:
            state = tuple(h[k].detach() for h in hx)  # this layer's state at t = -1
        else:
            zeros = torch.zeros(B, rnn.hidden_size, dtype=x.dtype)
            state = (zeros, zeros.clone()) if rnn.is_lstm else (zeros,)
        for t in range(T):
            if k == 0:
                inp = x[t].detach().requires_grad_()
            else:
                inp = links.recv((B, rnn.input_size), x.dtype, k - 1, t).requires_grad_()
            prev = tuple(s.detach().requires_grad_() for s in state)
            began = time.perf_counter()
            with torch.enable_grad():
                new = rnn.step(inp, prev, leaves)
            rnn.timeline.append(Event(k, "F", t, began, time.perf_counter()))
            if k < num_layers - 1:
                sends.append((links.send(new[0].detach(), k + 1, t), new[0]))
            steps.append((inp, prev, new))
            state = new
        for work, _ in sends:
            links.wait(work, "wavefront send")
        output = torch.stack([new[0].detach() for _, _, new in steps])  # (T, B, H)
        if links is not None:
            dist.broadcast(output, src=links.ranks[-1], group=links.group)
        ctx.rnn, ctx.steps, ctx.leaves, ctx.x_shape = rnn, steps, leaves, x.shape
        ctx.num_hx = num_hx
        rnn.final_state = tuple(s.detach() for s in state)
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple:
        rnn, steps, leaves = ctx.rnn, ctx.steps, ctx.leaves
        k, num_layers, links = rnn.layer, rnn.num_layers, rnn.links
        T = len(steps)
        recurrent = [torch.zeros_like(s) for s in steps[-1][2]]  # dL/d(state) from step t+1
        grad_x = torch.zeros(ctx.x_shape, dtype=grad_output.dtype)
        sends = []
        for t in reversed(range(T)):
            inp, prev, new = steps[t]
            if k == num_layers - 1:
                from_above = grad_output[t]
            else:
                from_above = links.recv(new[0].shape, new[0].dtype, k + 1, T + t)
            grads = [from_above + recurrent[0], *recurrent[1:]]
            began = time.perf_counter()
            torch.autograd.backward(list(new), grads)
            rnn.timeline.append(Event(k, "B", t, began, time.perf_counter()))
            recurrent = [p.grad if p.grad is not None else torch.zeros_like(p) for p in prev]
            if k > 0:
                sends.append((links.send(inp.grad, k - 1, T + t), inp.grad))
            else:
                grad_x[t] = inp.grad
        for work, _ in sends:
            links.wait(work, "wavefront gradient send")
        if links is not None:
            dist.broadcast(grad_x, src=links.ranks[0], group=links.group)
        # dL/d(initial state): what the reverse wave carried back past t = 0, every layer's
        grad_hx = [rnn.gather_layers(g) for g in recurrent[: ctx.num_hx]]
        return (grad_x, None, None, *grad_hx, *[leaf.grad for leaf in leaves])


class WavefrontRNN(nn.Module):
    """This rank's layer of a stacked `nn.LSTM` / `nn.GRU`, run as a wavefront over `group`."""

    def __init__(
        self,
        rnn: nn.LSTM | nn.GRU,
        *,
        group: dist.ProcessGroup | None = None,
        timeout_s: float | None = None,
    ) -> None:
        super().__init__()
        if type(rnn) not in (nn.LSTM, nn.GRU):
            raise ValueError(f"wavefront takes an nn.LSTM or nn.GRU, got {type(rnn).__name__}")
        size = dist.get_world_size(group) if dist.is_initialized() else 1
        if rnn.num_layers != size:
            raise ValueError(f"{rnn.num_layers} layers need {rnn.num_layers} ranks, got {size}")
        if rnn.bidirectional or getattr(rnn, "proj_size", 0) or rnn.dropout:
            raise ValueError("wavefront supports unidirectional RNNs without projection or dropout")
        self.layer = dist.get_rank(group) if dist.is_initialized() else 0
        self.num_layers, self.batch_first = rnn.num_layers, rnn.batch_first
        self.is_lstm = isinstance(rnn, nn.LSTM)
        self.hidden_size = rnn.hidden_size
        self.input_size = rnn.input_size if self.layer == 0 else rnn.hidden_size
        cell_type = nn.LSTMCell if self.is_lstm else nn.GRUCell
        # on the meta device: no memory and no random draws (every parameter is replaced below)
        self.cell = cell_type(self.input_size, rnn.hidden_size, bias=rnn.bias, device="meta")
        for name in _PARAM_NAMES:  # the rnn's own parameters of this layer: no copies
            if hasattr(rnn, f"{name}_l{self.layer}"):
                setattr(self.cell, name, getattr(rnn, f"{name}_l{self.layer}"))
        self.names = [n for n, _ in self.cell.named_parameters()]
        timeout = default_timeout_s() if timeout_s is None else timeout_s
        self.links = Links(group, timeout) if size > 1 else None
        self.final_state: tuple[torch.Tensor, ...] = ()
        self.timeline: list[Event] = []
        """This layer's cell steps of the last forward (and backward): F/B events, one per t."""

    def step(self, inp: torch.Tensor, state: tuple, params: list[torch.Tensor]) -> tuple:
        """One cell step with `params` standing in for the cell's parameters."""
        weights = dict(zip(self.names, params))
        out = functional_call(self.cell, weights, (inp, state if self.is_lstm else state[0]))
        return tuple(out) if self.is_lstm else (out,)

    def forward(self, x: torch.Tensor, hx: Any = None) -> tuple[torch.Tensor, Any]:
        """Same call and results as the unsplit RNN: `(output, h_n)` or `(output, (h_n, c_n))`.

        `hx` (`h_0`, or `(h_0, c_0)` for an LSTM; each `(L, B, H)`, the same on every rank) is
        the initial state, zeros if None; its gradient flows back as through the unsplit RNN.
        """
        if self.batch_first:
            x = x.transpose(0, 1)  # (B, T, I) -> (T, B, I)
        parts = () if hx is None else tuple(hx) if self.is_lstm else (hx,)
        expected = (self.num_layers, x.shape[1], self.hidden_size)
        for part in parts:
            if tuple(part.shape) != expected:
                raise ValueError(
                    f"wavefront layer {self.layer}: initial state of shape {tuple(part.shape)}, "
                    f"expected (num_layers, batch, hidden) = {expected}"
                )
        self.timeline = []
        output = _Wavefront.apply(x, self, len(parts), *parts, *self.cell.parameters())
        finals = [self.gather_layers(s) for s in self.final_state]  # each (L, B, H)
        if self.batch_first:
            output = output.transpose(0, 1)
        return output, (tuple(finals) if self.is_lstm else finals[0])

    def gather_timeline(self) -> list[Event]:
        """Every layer's events of the last forward/backward, by start time; collective."""
        if self.links is None:
            return list(self.timeline)
        parts: list[Any] = [None] * self.num_layers
        dist.all_gather_object(parts, self.timeline, group=self.links.group)
        return sorted((e for part in parts for e in part), key=lambda e: e.start)

    def gather_layers(self, state: torch.Tensor) -> torch.Tensor:
        """Stack every layer's `state` (B, H) into `(L, B, H)`, layer order; collective."""
        if self.links is None:
            return state.unsqueeze(0)
        parts = [torch.empty_like(state) for _ in range(self.num_layers)]
        dist.all_gather(parts, state.contiguous(), group=self.links.group)
        return torch.stack(parts)


def wavefront(
    rnn: nn.LSTM | nn.GRU,
    *,
    group: dist.ProcessGroup | None = None,
    timeout_s: float | None = None,
) -> WavefrontRNN:
    """Split a stacked LSTM/GRU one layer per rank of `group`, run as a wavefront.

    Every wait between layers is bounded by `timeout_s` (None: this rank's `Context.timeout_s`).
    """
    return WavefrontRNN(rnn, group=group, timeout_s=timeout_s)
