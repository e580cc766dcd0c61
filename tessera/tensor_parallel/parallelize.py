"""Apply tensor parallelism to a dense module by a plan, and gather the dense state back.

`parallelize(module, {"mlp.up": "column", "mlp.proj": "row"}, group=tp_group)` replaces each
submodule whose name matches a pattern (fnmatch) by its parallel version, slicing its existing
weights, so the result computes what the dense module did. Styles:

- "column": nn.Linear -> ColumnParallelLinear (output features split); Hugging Face's Conv1D ->
  ColumnParallelConv1D (W's dimension 1 split); nn.Conv2d -> ChannelParallelConv2d (output
  channels split, gathered after unless a "row" Conv2d takes them split).
- "row": nn.Linear -> RowParallelLinear (input features split; follows a column layer); Conv1D ->
  RowParallelConv1D (W's dimension 0 split); nn.Conv2d -> RowParallelConv2d (input channels split,
  partial outputs summed).
- "embedding": nn.Embedding -> ColumnParallelEmbedding, split over the embedding dimension and
  all-gathered after the lookup: torch's `ColwiseParallel` on an `nn.Embedding`. Chosen over
  Megatron's vocabulary split for the general case because the output is whole on every rank
  whatever follows, `padding_idx` keeps working and no id is masked; the vocabulary split stays
  available as "vocab" (its partial sums all-reduced), for a vocab-parallel loss.
- "vocab": nn.Embedding -> VocabParallelEmbedding; nn.Linear -> ColumnParallelLinear whose split
  logits feed `vocab_parallel_cross_entropy`.
- "column_gather": nn.Linear / Conv1D -> column-parallel with its output all-gathered.

Attention: when a plan splits the q/k/v projections of an attention class `heads.py` knows
(Hugging Face's GPT2Attention, BertSelfAttention), the fused GPT-2 projection is split per q/k/v
block, the q/k/v (and GPT-2's c_proj) must all be in the plan with the right styles, the head count
must divide, and after the split the module's head-count attributes are made local.

A "row" Conv2d pairs with the nearest "column" Conv2d registered before it (module order), as
the MLP's two linears pair: the column conv then keeps its output channels split, only
channel-wise layers (activations, pooling) may sit between the two, and the pair all-reduces
once forward and once backward. The plan is refused if a row conv has no column conv before it
or the column conv's output channels are not the row conv's input channels.

Every check (a pattern matching nothing, a module matched by two patterns, a module type the style
cannot split, a dimension the group size does not divide, a weight tied to a module outside the
split, an attention split incompletely, an unpaired or mismatched row conv, a grouped conv)
raises one ValueError naming the module, before any module is changed or any message sent.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from fnmatch import fnmatch

import torch
import torch.distributed as dist
from torch import nn

from tessera.tensor_parallel._comm import all_gather_dim, group_size
from tessera.tensor_parallel.heads import HeadSplit, head_split_of
from tessera.tensor_parallel.layers import _Parallel, keep_frozen, shard
from tessera.tensor_parallel.styles import KINDS, STYLES, Group, Kind

__all__ = ["STYLES", "check_plan", "full_state_dict", "load_full_state_dict", "parallelize"]


@dataclass
class _Target:
    """One submodule the plan replaces."""

    name: str
    style: str
    module: nn.Module
    kind: Kind
    chunks: int = 1


def _pair_convolutions(targets: list[_Target]) -> set[str]:
    """Names of the column convs a row conv follows (their output stays split); ValueError for
    a row conv without a matching column conv before it."""
    paired: set[str] = set()
    open_column: tuple[str, nn.Module] | None = None  # the last unpaired column conv
    for target in targets:
        name, style, sub = target.name, target.style, target.module
        if not isinstance(sub, nn.Conv2d):
            continue
        if style == "column":
            open_column = (name, sub)
        elif style == "row":
            if open_column is None:
                raise ValueError(
                    f"{name}: a row-parallel Conv2d takes input channels split by a column-"
                    f"parallel Conv2d before it; the plan has none (add one as 'column')"
                )
            column_name, column = open_column
            if column.out_channels != sub.in_channels:
                raise ValueError(
                    f"{name}: its {sub.in_channels} input channels do not match the "
                    f"{column.out_channels} output channels of the column conv {column_name}"
                )
            paired.add(column_name)
            open_column = None
    return paired


def _refuse_adapter(named: Mapping[str, nn.Module], name: str) -> None:
    """ValueError when `name` is, or sits inside, an adapter wrapper (peft's LoRA and the other
    tuners keep the wrapped layer as `base_layer`): splitting the base layer without the
    adapter's own matrices would add a full output to a rank's share of it."""
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        outer = ".".join(parts[:k])
        if isinstance(getattr(named[outer], "base_layer", None), nn.Module):
            kind = type(named[outer])
            raise ValueError(
                f"{name}: {outer} is wrapped by an adapter ({kind.__module__}.{kind.__name__}, "
                f"e.g. a peft LoRA layer), which tensor parallelism cannot split; leave it out "
                f"of the plan (split the layers the adapter does not wrap) or merge the adapter "
                f"first (peft's merge_and_unload)"
            )


def _match_plan(module: nn.Module, plan: Mapping[str, str]) -> list[_Target]:
    """The submodules `plan` names, in registration order; ValueError for an unknown style, a
    pattern matching nothing, a module matched twice or of a type its style cannot split."""
    named = dict(module.named_modules())
    order = {name: k for k, name in enumerate(named)}
    targets: list[_Target] = []
    chosen: dict[str, str] = {}  # module name -> the pattern that matched it
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ValueError(
                f"unknown tensor-parallel style {style!r} for {pattern!r}; use {STYLES}"
            )
        matches = [name for name in named if name and fnmatch(name, pattern)]
        if not matches:
            raise ValueError(f"plan pattern {pattern!r} matches no submodule")
        for name in matches:
            if name in chosen:  # one module, two styles: which one wins would be silent
                raise ValueError(
                    f"{name} matches plan patterns {chosen[name]!r} and {pattern!r}; "
                    f"give each module one style"
                )
            chosen[name] = pattern
            sub = named[name]
            _refuse_adapter(named, name)
            kind = next((k for k in KINDS[style] if k.matches(sub)), None)
            if kind is None:
                allowed = [k.name for k in KINDS[style]]
                raise ValueError(
                    f"{name} is a {type(sub).__name__}, which style {style!r} cannot split; "
                    f"style {style!r} takes {allowed}"
                )
            kind.check(sub, name)
            targets.append(_Target(name, style, sub, kind))
    return sorted(targets, key=lambda target: order[target.name])


def _match_heads(
    module: nn.Module, targets: list[_Target], size: int
) -> list[tuple[nn.Module, HeadSplit]]:
    """The attention modules whose heads the plan splits (`heads.py`); sets the fused
    projections' `chunks`. ValueError for an attention split incompletely or not at all."""
    by_name = {target.name: target for target in targets}
    found = []
    for name, attn in module.named_modules():
        rule = head_split_of(attn)
        prefix = f"{name}." if name else ""
        if rule is None or not any(prefix + c in by_name for c in rule.column + rule.row):
            continue
        reason = rule.refuse(attn)
        if reason:
            raise ValueError(f"{name or type(attn).__name__}: {reason}")
        for children, style in ((rule.column, "column"), (rule.row, "row")):
            for child in children:
                target = by_name.get(prefix + child)
                if target is None or target.style != style:
                    got = f"style {target.style!r}" if target else "not in the plan"
                    raise ValueError(
                        f"{name}: a {type(attn).__name__} splits by heads only with "
                        f"{list(rule.column)} 'column'"
                        + (f" and {list(rule.row)} 'row'" if rule.row else "")
                        + f"; {prefix + child} is {got}"
                    )
                target.chunks = rule.chunks.get(child, 1)
        heads = rule.heads(attn)
        if heads % size:
            raise ValueError(
                f"{name}: its {heads} attention heads do not split over the tensor-parallel "
                f"size {size}"
            )
        found.append((attn, rule))
    return found


def _check_ties(module: nn.Module, targets: list[_Target]) -> None:
    """ValueError if a weight to split is shared with a module the plan leaves whole (a tied
    embedding and LM head): the split would untie them, and the dense model trains them as one."""
    owners: dict[int, list[str]] = defaultdict(list)
    for key, param in module.named_parameters(remove_duplicate=False):
        owners[id(param)].append(key)
    for target in targets:
        for leaf, param in target.module.named_parameters(recurse=False):
            others = [k for k in owners[id(param)] if k.rpartition(".")[0] != target.name]
            if others:
                raise ValueError(
                    f"{target.name}.{leaf} is tied to {others[0]}; splitting it would untie "
                    f"them (leave {target.name} out of the plan, or split both alike)"
                )


def _check_divisible(targets: list[_Target], size: int) -> None:
    for target in targets:
        dim, weight = target.kind.dim, target.module.weight
        if weight.shape[dim] % (size * target.chunks):
            blocks = f" in each of its {target.chunks} q/k/v blocks" if target.chunks > 1 else ""
            raise ValueError(
                f"{target.name}: weight dimension {dim} ({weight.shape[dim]}) is not divisible "
                f"by the tensor-parallel size {size}{blocks}"
            )


def _check_norms_between(module: nn.Module, targets: list[_Target], paired: set[str]) -> None:
    """ValueError for a channel norm (BatchNorm, InstanceNorm, GroupNorm) registered between a
    column conv whose output stays split and its row conv: it holds every channel's statistics
    and parameters but would see this rank's share of the channels."""
    names = [name for name in (t.name for t in targets) if name in paired]
    rows = [t.name for t in targets if t.style == "row" and isinstance(t.module, nn.Conv2d)]
    order = list(dict(module.named_modules()))
    norms = (nn.modules.batchnorm._NormBase, nn.GroupNorm)
    for column in names:
        start = order.index(column)
        end = min((order.index(r) for r in rows if order.index(r) > start), default=len(order))
        for name in order[start + 1 : end]:
            sub = module.get_submodule(name)
            if isinstance(sub, norms) and not name.startswith(column + "."):
                raise ValueError(
                    f"{name}: a {type(sub).__name__} after the column-parallel conv {column} "
                    f"normalises all its channels, but between {column} and the row conv after "
                    f"it each rank holds only its share of them; leave the pair out of the plan "
                    f"(or split a conv pair without a norm between)"
                )


def check_plan(module: nn.Module, plan: Mapping[str, str], size: int) -> None:
    """Every check `parallelize` runs before it replaces anything, for a tensor-parallel size of
    `size`, without a process group: a launcher refuses a bad plan before any rank starts.
    ValueError with the first problem; `module` is left as it was."""
    targets = _match_plan(module, plan)
    _match_heads(module, targets, size)
    _check_divisible(targets, size)
    _check_ties(module, targets)
    _check_norms_between(module, targets, _pair_convolutions(targets))


def parallelize(module: nn.Module, plan: Mapping[str, str], *, group: Group = None) -> nn.Module:
    """Replace the submodules `plan` names by tensor-parallel versions in place; return `module`.

    Every check runs before the first replacement, so a refused plan leaves `module` unchanged.
    """
    size = group_size(group)
    targets = _match_plan(module, plan)
    attentions = _match_heads(module, targets, size)
    _check_divisible(targets, size)
    _check_ties(module, targets)
    paired = _pair_convolutions(targets)
    _check_norms_between(module, targets, paired)
    for target in targets:
        parent_name, _, child = target.name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        built = target.kind.build(target.module, group, target.name in paired, target.chunks)
        keep_frozen(target.module, built)
        setattr(parent, child, built)
    for attn, rule in attentions:
        rule.localize(attn, size)
    return module


def _gather_param(
    tensor: torch.Tensor, layer: _Parallel, dim: int, group: dist.ProcessGroup | None
) -> torch.Tensor:
    gathered = all_gather_dim(tensor.detach(), group, dim)
    if layer.chunks == 1:
        return gathered
    # each rank holds [chunk_0 slice, chunk_1 slice, ...]: regroup slices by chunk
    size = group_size(group)
    per_rank = gathered.chunk(size, dim=dim)
    pieces = [part.chunk(layer.chunks, dim=dim) for part in per_rank]
    return torch.cat([pieces[r][c] for c in range(layer.chunks) for r in range(size)], dim=dim)


def _split_layers(module: nn.Module) -> dict[str, _Parallel]:
    return {name: sub for name, sub in module.named_modules() if isinstance(sub, _Parallel)}


def full_state_dict(module: nn.Module, *, group: Group = None) -> dict[str, torch.Tensor]:
    """The dense model's state: what `model.state_dict()` returned before `parallelize`.

    The same meaning as `tessera.zero.full_state_dict(model)`: the user's plain keys (a split layer
    keeps its dense layer's parameter names and layout, Conv1D's `(in, out)` included), every
    tensor whole (split ones all-gathered, fused q/k/v blocks put back in q, k, v order), detached
    copies, complete on every rank; `model.load_state_dict` of an unsplit copy takes it as is.
    Collective: every rank of each split layer's group must call it. Each layer is gathered over
    the group it was split over; `group`, if given, is used for all of them instead (callers
    before this was recorded passed the group they split with).
    """
    state: dict[str, torch.Tensor] = {}
    layers = _split_layers(module)
    for key, value in module.state_dict().items():
        owner, _, leaf = key.rpartition(".")
        layer = layers.get(owner)
        if layer is not None and leaf in layer.shard_dims:
            over = group if group is not None else layer.group
            value = _gather_param(value, layer, layer.shard_dims[leaf], over)
        state[key] = value.detach().clone()
    return state


def load_full_state_dict(module: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Load a dense state (as `full_state_dict` returns it) into a split `module`: each split
    tensor is sliced to this rank's shard (per q/k/v block where fused). No communication."""
    layers = _split_layers(module)
    local = {}
    for key in module.state_dict():
        if key not in state:
            raise KeyError(f"the dense state has no {key!r}")
        value = state[key]
        owner, _, leaf = key.rpartition(".")
        layer = layers.get(owner)
        if layer is not None and leaf in layer.shard_dims:
            value = shard(value, layer.shard_dims[leaf], layer.group, layer.chunks)
        local[key] = value
    module.load_state_dict(local)
