"""Any model cut at named modules: PyTorch's pipeline frontend splits, tessera's runner runs.

`split=["blocks.2", "head"]` starts a new stage at each named module, as
`torch.distributed.pipelining.pipeline(model, mb_args, mb_kwargs, split_spec={name:
SplitPoint.BEGINNING})` does: the model's forward is traced once with `torch.export` (on the first
micro-batch, on every rank alike) and PyTorch's `Pipe` cuts the graph into one `GraphModule` per
stage. Why PyTorch's frontend rather than a tessera partitioner: the hard parts of cutting an
arbitrary forward (a residual stream, a parameter used outside any submodule, a weight tied
between the first and the last stage, which values cross which boundary) are exactly what `Pipe`
already solves on the exported graph, and it keeps the user's own `nn.Parameter` objects (so an
optimizer built on the model trains the stage, and a stage's state-dict keys are the model's).
What tessera adds is the execution: its schedules, links, deferral-free backward, tied-gradient
sum and dp sharding, unchanged from the `nn.Sequential` path.

Values between stages: the root graph of `Pipe.split_gm` says which stage produces each value and
which stages use it. The model's inputs are read by every stage from its own micro-batch (the
engine gives every rank the batch), so only computed values travel, and a value a later stage
needs passes through the stages between (stage s sends everything produced at or before s that a
stage after s uses: a tuple of tensors, `messages.py`).

The frontend is called in its two steps (`torch.export.export` after `annotate_split_points`, then
`Pipe._from_traced`), which is what the public `pipeline()` does, because the export's input and
output specs are needed to flatten each micro-batch and to rebuild the model's output (a Hugging
Face `ModelOutput` with its `.loss`) on the last stage, and `pipeline()` does not keep them.

Modes: `torch.export` bakes each module's mode into the graph (dropout's draws, batch norm's
batch statistics and its running-statistics update), so a graph holding such operations is traced
a second time in eval mode for evaluation (`trace_stages`), with the rows left symbolic where the
model allows. A module called twice is the same module on both calls (`Pipe` names the second
`name@1`; `model_key`). A Hugging Face config's `use_cache` is off while traced (`_no_cache`).

Limits (the errors say so): the forward must be traceable by `torch.export` (no data-dependent
Python control flow); the training graph is specialised to the traced micro-batch shapes, so every
training micro-batch must have them (evaluation: see above); the stages run ATen graphs, not the
model's modules, so a tensor-parallel plan (which swaps modules) cannot apply inside them.
"""

from __future__ import annotations

import contextlib
import inspect
import operator
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import SymInt, fx, nn

from tessera.pipeline.microbatch import batch_rows

__all__ = ["TracedStage", "check_split", "model_key", "trace_stages"]

_CALL_SUFFIX = re.compile(r"@\d+(?=\.|$)")


def model_key(name: str) -> str:
    """The model's own name of a traced stage's parameter or buffer: `Pipe` names the modules
    of a module's second, third... call `shared@1`, `shared@2` (the same module, so the same
    tensors); the model knows them as `shared`."""
    return _CALL_SUFFIX.sub("", name)


def check_split(model: nn.Module, split: Sequence[str], num_stages: int) -> list[str]:
    """Validate split points before anything runs: ValueError naming the module otherwise."""
    split = [str(name) for name in split]
    if len(split) + 1 != num_stages:
        raise ValueError(
            f"split={split} gives {len(split) + 1} stages, but the pipeline has {num_stages} "
            f"ranks: name {num_stages - 1} module(s) where a new stage starts"
        )
    for k, name in enumerate(split):
        if name in split[:k]:
            raise ValueError(f"split point {name!r} is given twice: the stage between is empty")
        if name == "":
            raise ValueError("split point '' is the whole model: name a submodule")
        try:
            model.get_submodule(name)
        except AttributeError:
            raise ValueError(
                f"split point {name!r}: {type(model).__name__} has no submodule {name!r}"
            ) from None
    return split


def call_args(inputs: Any) -> tuple[tuple, dict[str, Any]]:
    """How a micro-batch calls the model: a dict as keywords, anything else as one argument."""
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    return (inputs,), {}


class TracedStage:
    """One stage of the cut graph: reads the micro-batch and the received tuple, runs its
    `GraphModule`, returns the tuple the next stage needs (the last stage: the model's output)."""

    def __init__(
        self,
        module: fx.GraphModule,
        index: int,
        root: fx.Graph,
        stage_of: dict[str, int],
        num_stages: int,
        in_spec: pytree.TreeSpec,
        out_spec: pytree.TreeSpec,
    ) -> None:
        self.module = module
        self.index = index
        self.in_spec, self.out_spec = in_spec, out_spec
        nodes = list(root.nodes)
        self._inputs = [n.name for n in nodes if n.op == "placeholder"]
        call = [n for n in nodes if n.op == "call_module"][index]
        self._args = [a.name for a in call.args]
        self._call = call.name
        self._items = [  # (name, position) of this stage's getitem nodes
            (n.name, n.args[1])
            for n in nodes
            if n.op == "call_function" and n.target is operator.getitem and n.args[0] is call
        ]
        output = next(n for n in nodes if n.op == "output")
        self._outputs = [a.name for a in pytree.tree_leaves(output.args[0])]
        self.receives = _boundary(nodes, stage_of, index - 1, num_stages)
        """Names of the values this stage receives from the previous one, in message order."""
        self.sends = _boundary(nodes, stage_of, index, num_stages)
        """Names of the values this stage sends to the next one, in message order."""
        placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
        self._ints = {  # received sizes (a symbolic graph's SymInt): they travel as tensors
            arg
            for arg, node in zip(self._args, placeholders)
            if isinstance(node.meta.get("val"), (int, SymInt))
        }
        self.for_eval: TracedStage | None = None
        """This stage of the graph traced in eval mode (`trace_stages`): what evaluation runs."""
        self.rows: int | None = None
        """The rows every micro-batch must have (the traced ones); None: any."""
        self.unheld: list[str] = []
        """State keys of the model no stage's graph uses (stage 0 keeps them)."""

    @property
    def output_fields(self) -> list[str]:
        """Names in the model's output (a dict or a Hugging Face `ModelOutput`); [] for others."""
        context = self.out_spec.context
        return [str(k) for k in context] if isinstance(context, (list, tuple)) else []

    def full_key(self, key: str) -> str:
        """A stage's state-dict key is the model's own (PyTorch keeps the qualified names, with
        `@N` for a module's later calls: `model_key`)."""
        return model_key(key)

    def flat_inputs(self, inputs: Any) -> list[Any]:
        """The micro-batch's leaves in the traced order (ValueError if its structure differs)."""
        args, kwargs = call_args(inputs)
        order = self.in_spec.children()[1].context if kwargs else []
        if kwargs and set(order) == set(kwargs):
            kwargs = {k: kwargs[k] for k in order}
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if spec != self.in_spec:
            raise ValueError(
                f"the batch's structure {spec} differs from the traced one {self.in_spec}"
            )
        return leaves

    def run(self, inputs: Any, received: tuple[torch.Tensor, ...]) -> Any:
        """Run the stage on one micro-batch."""
        env: dict[str, Any] = dict(zip(self._inputs, self.flat_inputs(inputs)))
        env.update(zip(self.receives, received))
        result = self.module(*[int(env[a]) if a in self._ints else env[a] for a in self._args])
        env[self._call] = result
        for name, position in self._items:
            env[name] = result[position]
        if self.sends:
            values = [env[name] for name in self.sends]
            device = next((v.device for v in values if isinstance(v, torch.Tensor)), None)
            return tuple(_as_tensor(v, device) for v in values)
        return pytree.tree_unflatten([env[name] for name in self._outputs], self.out_spec)


def _as_tensor(value: Any, device: torch.device | None) -> torch.Tensor:
    """A value crossing a stage boundary as a tensor (a symbolic size is a Python int here)."""
    return value if isinstance(value, torch.Tensor) else torch.tensor(value, device=device)


def _boundary(nodes: list[fx.Node], stage_of: dict[str, int], s: int, num_stages: int) -> list:
    """Values produced at or before stage `s` and used after it (graph order)."""
    if s < 0 or s >= num_stages - 1:
        return []
    out = []
    for node in nodes:
        if stage_of.get(node.name, -1) < 0 or stage_of[node.name] > s:
            continue
        users = [
            num_stages - 1 if u.op == "output" else stage_of.get(u.name, -1) for u in node.users
        ]
        if node.op == "call_module" and all(
            u.op == "call_function" and u.target is operator.getitem for u in node.users
        ):
            continue  # a tuple result: its items travel, not the tuple
        if any(user > s for user in users):
            out.append(node.name)
    return out


def _empty_stage_error(graph: fx.Graph, split: list[str], model: nn.Module) -> str | None:
    """Why the traced graph does not give one non-empty stage per split point, or None."""
    markers, segments, ops = [], [], 0
    for node in graph.nodes:
        if node.op == "call_function" and "pipe_split" in str(node.target):
            stack = node.meta.get("nn_module_stack") or {}
            markers.append(list(stack.values())[-1][0] if stack else "?")
            segments.append(ops)
            ops = 0
        elif node.op == "call_function":
            ops += 1
    segments.append(ops)
    name = type(model).__name__
    for point in split:
        count = markers.count(point)
        if count != 1:
            return (
                f"split point {point!r} runs {count} times in {name}.forward: a split point "
                "must be a module called exactly once"
            )
    for k, ops in enumerate(segments):
        if ops == 0:
            where = f"before {markers[k]!r}" if k == 0 else f"from {markers[k - 1]!r}"
            return f"split={split} leaves the stage {where} empty: no computation there"
    return None


def trace_stages(
    model: nn.Module, split: list[str], example: Any
) -> tuple[list[TracedStage], list[list[nn.Parameter]]]:
    """Trace `model` on the micro-batch `example`, cut it at `split`; every stage's runner and
    its parameters (the model's own objects), on every rank alike.

    `torch.export` bakes the module modes into the graph, so a training graph that holds
    anything a mode changes (dropout, batch norm, random draws, a buffer it updates) is cut twice:
    the training graph (each module's mode as the user left it) and, as each stage's `for_eval`,
    the evaluation graph (every module in eval mode, the micro-batch's rows left symbolic where
    the model allows it, so evaluation takes any row count). A graph with none of these
    evaluates on its training graph (tracing costs seconds per graph), which fixes the rows
    where a sizing operation takes them (`TracedStage.rows`). Both under autograd, whatever the
    caller's grad mode (an evaluation may come first).
    """
    with torch.enable_grad(), _no_cache(model):
        stages, rows, by_mode = _cut(model, split, example, dynamic=False)
        if by_mode:
            modes = [(m, m.training) for m in model.modules()]
            model.eval()
            try:
                evaluation, rows, _ = _cut(model, split, example, dynamic=True)
            finally:
                for module, training in modes:
                    module.training = training
            for stage, for_eval in zip(stages, evaluation):
                stage.for_eval = for_eval
    for stage in stages:
        (stage.for_eval or stage).rows = rows
    held = {
        id(t) for stage in stages for t in (*stage.module.parameters(), *stage.module.buffers())
    }
    stages[0].unheld = [  # e.g. an unused head: kept by stage 0, so that no state is lost
        key for key, t in model.state_dict(keep_vars=True).items() if id(t) not in held
    ]
    return stages, [list(stage.module.parameters()) for stage in stages]


@contextlib.contextmanager
def _no_cache(model: nn.Module) -> Iterator[None]:
    """A Hugging Face model's `config.use_cache` off while traced (restored after).

    With it on (the default of most configs) the forward returns a cache object, which
    `torch.export` cannot trace, and training has no use for it: Hugging Face's Trainer turns
    it off too when it trains with gradient checkpointing.
    """
    configs = {
        id(c): c
        for m in model.modules()
        if getattr(c := getattr(m, "config", None), "use_cache", None)
    }
    for config in configs.values():  # (T5's decoder stack has a config of its own)
        config.use_cache = False
    try:
        yield
    finally:
        for config in configs.values():
            config.use_cache = True


def _export(model: nn.Module, split: list[str], example: Any, dynamic: bool) -> Any:
    """`torch.export` of `model` annotated at `split` (dim 0 of the batch symbolic if `dynamic`:
    None if the model does not allow it)."""
    # (imported here, when a model is traced: torch's pipelining package takes ~2 s to import,
    # which listing the strategies, `tessera train --help` and config checks need not pay)
    from torch.distributed.pipelining._IR import SplitPoint, annotate_split_points
    from torch.export import Dim

    args, kwargs = call_args(example)
    shapes = None
    if dynamic:
        rows = batch_rows(example)
        try:
            bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
        except TypeError:
            return None
        shapes = pytree.tree_map(
            lambda t: (
                {0: Dim.AUTO}
                if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == rows
                else None
            ),
            dict(bound),
        )
    annotate_split_points(model, {name: SplitPoint.BEGINNING for name in split})
    try:
        return torch.export.export(model, args, kwargs, dynamic_shapes=shapes)
    except Exception as exc:
        if dynamic:
            return None  # traced again with the rows fixed
        raise ValueError(
            f"{type(model).__name__} cannot be split at {split}: torch.export could not "
            f"trace its forward ({type(exc).__name__}: {str(exc).splitlines()[0]}). A model "
            "split at named modules needs a forward without data-dependent Python control "
            "flow; an nn.Sequential split at its top-level layers needs no tracing"
        ) from exc
    finally:
        for name in split:  # undo annotate_split_points: the user's modules stay as they were
            module = model.get_submodule(name)
            module.__dict__.pop("forward", None)
            module.__dict__.pop("_orig_forward", None)


def _cut(
    model: nn.Module, split: list[str], example: Any, *, dynamic: bool
) -> tuple[list[TracedStage], int | None, bool]:
    """The stages of one traced graph, the rows every micro-batch must have (None: any), and
    whether the graph holds an operation a module's mode changes (`_depends_on_mode`)."""
    from torch.distributed.pipelining._IR import MultiUseParameterConfig, Pipe  # (see _export)

    program = _export(model, split, example, dynamic) if dynamic else None
    if program is None:
        program = _export(model, split, example, False)
    rows = batch_rows(example)
    if (dynamic and _symbolic_rows(program)) or not _bakes_rows(program, rows):
        rows = None
    reason = _empty_stage_error(program.graph, split, model)
    if reason is not None:
        raise ValueError(reason)
    pipe = Pipe._from_traced(model, program, MultiUseParameterConfig.REPLICATE)
    root = pipe.split_gm.graph
    calls = [n for n in root.nodes if n.op == "call_module"]
    stage_of: dict[str, int] = {}
    for node in root.nodes:
        if node.op == "call_module":
            stage_of[node.name] = calls.index(node)
        elif node.op == "call_function" and node.target is operator.getitem:
            stage_of[node.name] = stage_of[node.args[0].name]
        elif node.op == "call_function":
            raise ValueError(f"unexpected computation {node.target} between the stages")
    spec = program.call_spec
    stages = [
        TracedStage(
            pipe.split_gm.get_submodule(call.target),
            k,
            root,
            stage_of,
            len(calls),
            spec.in_spec,
            spec.out_spec,
        )
        for k, call in enumerate(calls)
    ]
    for stage in stages:
        _use_model_tensors(stage.module, model)
    return stages, rows, _depends_on_mode(program)


_SHAPE_OPS = re.compile(r"view|reshape|expand|zeros|ones|full|empty|arange|split|repeat|new_")
"""ATen operations that take sizes: where a graph traced with fixed shapes keeps the rows."""


def _bakes_rows(program: Any, rows: int) -> bool:
    """True if a sizing operation of the graph takes the integer `rows` (conservatively: also
    when another size happens to equal it), so that the graph runs only that many rows. A graph
    without one (linear layers, convolutions, activations) runs any rows."""
    for node in program.graph.nodes:
        name = str(node.target) if node.op == "call_function" else ""
        if _SHAPE_OPS.search(name):
            leaves = pytree.tree_leaves((node.args, node.kwargs))
            if any(type(v) is int and v == rows for v in leaves):
                return True
    return False


_MODE_OPS = re.compile(r"dropout|bernoulli|rand|batch_norm|instance_norm")
"""ATen operations whose result (or whose effect on buffers) eval mode may change."""


def _depends_on_mode(program: Any) -> bool:
    """True if the exported graph updates a buffer or runs an operation of `_MODE_OPS` (but a
    dropout of probability 0, as a config with dropout 0 builds, changes nothing)."""
    if program.graph_signature.buffers_to_mutate:
        return True
    for node in program.graph.nodes:
        name = str(node.target) if node.op == "call_function" else ""
        if "scaled_dot_product" in name:  # attention's own dropout
            args = dict(enumerate(node.args))
            if node.kwargs.get("dropout_p", args.get(4, 0.0)) != 0:
                return True
        if not _MODE_OPS.search(name):
            continue
        probability = node.args[1] if "dropout" in name and len(node.args) > 1 else None
        if probability != 0:
            return True
    return False


def _symbolic_rows(program: Any) -> bool:
    """True if the exported graph left dim 0 of its batched inputs symbolic."""
    for node in program.graph.nodes:
        value = node.meta.get("val") if node.op == "placeholder" else None
        if isinstance(value, torch.Tensor) and value.dim() and isinstance(value.shape[0], SymInt):
            return True
    return False


def _use_model_tensors(stage: nn.Module, model: nn.Module) -> None:
    """Point the stage at the model's own parameters and buffers (by qualified name).

    `Pipe` keeps most of them, but torch.export lifts a tensor the forward reaches twice (a tied
    embedding) into a copy: training the copy would leave the model, the optimizer and the
    cross-stage gradient sum (which finds tied parameters by identity) each on another tensor.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    for kind, own in (("parameter", params), ("buffer", buffers)):
        named = stage.named_parameters if kind == "parameter" else stage.named_buffers
        for name, tensor in list(named(remove_duplicate=False)):
            key = model_key(name)
            if key not in own:  # (a buffer may be a constant the trace lifted)
                if kind == "parameter":
                    raise ValueError(f"traced stage parameter {name!r} is not one of the model's")
                continue
            if tensor is not own[key]:
                owner, _, leaf = name.rpartition(".")
                module = stage.get_submodule(owner)
                table = module._parameters if kind == "parameter" else module._buffers
                table[leaf] = own[key]
