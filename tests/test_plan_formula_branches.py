"""The planner's closed forms, every branch: activation memory against a tensor-by-tensor hand count
of Korthikanti et al. 2022, and the branches without recomputation of Narayanan et al. 2021.

The oracle is Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"
(2022), section 4.1, written out here tensor by tensor (16-bit values: 2 bytes per element,
dropout masks 1 byte) rather than as the closed forms the planner adds up, so that a branch that
divides by the wrong degree, keeps a term it should drop or drops one it should keep disagrees
with the count. Which tensors tensor parallelism shards (section 4.2.1: the ones between the
column- and the row-parallel linear layers), which sequence parallelism shards in addition (4.2.2:
the rest, the layer norms' and dropouts' inputs along the sequence), which selective
recomputation drops (5: the attention's softmax, its dropout and their products, the s^2 terms)
and what full recomputation keeps (only the layer's input, sharded along the sequence only when
sequence parallelism shards it, as Megatron-LM stores it) are the paper's.
"""

from __future__ import annotations

import itertools

import pytest

from tessera.plan.formulas import RECOMPUTE, activation_bytes_per_layer

# (tensor kept for backward, bytes per element, elements in units of "sbh" or "as2b",
#  sharded by tensor parallelism, recomputed by selective recomputation)
LAYER_TENSORS = [
    # attention block: 11 sbh + 5 a s^2 b
    ("QKV projection input", 2, "sbh", False, False),
    ("Q and K for Q K^T", 2 * 2, "sbh", True, False),
    ("softmax output", 2, "as2b", True, True),
    ("softmax dropout mask", 1, "as2b", True, True),
    ("dropout output (times V)", 2, "as2b", True, True),
    ("V", 2, "sbh", True, False),
    ("output projection input", 2, "sbh", True, False),
    ("attention dropout mask", 1, "sbh", False, False),
    # MLP block: 19 sbh (the hidden layer is 4h wide)
    ("first linear input", 2, "sbh", False, False),
    ("GeLU input", 2 * 4, "sbh", True, False),
    ("second linear input", 2 * 4, "sbh", True, False),
    ("MLP dropout mask", 1, "sbh", False, False),
    # two layer norms: 4 sbh
    ("first layer norm input", 2, "sbh", False, False),
    ("second layer norm input", 2, "sbh", False, False),
]


def hand_count(s: int, b: int, h: int, a: int, t: int, sp: bool, recompute: str) -> float:
    """Bytes one rank keeps, summed tensor by tensor from LAYER_TENSORS."""
    if recompute == "full":  # only the layer's input (2 bytes an element) is kept
        return 2 * s * b * h / (t if sp else 1)
    total = 0.0
    for _name, size, unit, tp_sharded, selective_drops in LAYER_TENSORS:
        if recompute == "selective" and selective_drops:
            continue
        elements = s * b * h if unit == "sbh" else a * s * s * b
        total += size * elements / (t if tp_sharded or sp else 1)
    return total


def test_the_hand_count_is_the_papers_34_and_5as_over_h():
    """The table adds up to section 4.1's totals: 34 sbh + 5 a s^2 b, of which 10 sbh are
    replicated by tensor parallelism (Table 2's first two rows), and 2 sbh under full
    recomputation (its last row)."""
    s, b, h, a = 3, 1, 1, 1
    sbh = sum(size for _, size, unit, _, _ in LAYER_TENSORS if unit == "sbh")
    as2b = sum(size for _, size, unit, _, _ in LAYER_TENSORS if unit == "as2b")
    replicated = sum(size for _, size, unit, tp, _ in LAYER_TENSORS if unit == "sbh" and not tp)
    assert (sbh, as2b, replicated) == (34, 5, 10)
    assert hand_count(s, b, h, a, 1, False, "none") == s * b * h * (34 + 5 * a * s / h)
    assert hand_count(s, b, h, a, 1, False, "full") == 2 * s * b * h


# GPT-3 175B at the paper's tensor-parallel size (5 a s / h = 80: the attention terms outweigh
# the rest, the paper's motivation for selective recomputation), and a small odd shape.
SHAPES = [(2048, 1, 12288, 96, 8), (16, 3, 8, 2, 2), (7, 5, 12, 3, 4)]


@pytest.mark.parametrize(("s", "b", "h", "a", "t"), SHAPES)
def test_every_branch_equals_the_hand_count(s, b, h, a, t):
    """Each recomputation variant without tensor parallelism, with it, and with it and sequence
    parallelism (and sequence parallelism at t = 1, which shards nothing)."""
    for recompute, (degree, sp) in itertools.product(
        RECOMPUTE, [(1, False), (1, True), (t, False), (t, True)]
    ):
        got = activation_bytes_per_layer(
            s, b, h, a, t=degree, sequence_parallel=sp, recompute=recompute
        )
        want = hand_count(s, b, h, a, degree, sp, recompute)
        assert got == pytest.approx(want, rel=1e-12), (recompute, degree, sp, got, want)


def test_gpt3_at_t8_in_the_papers_units():
    """GPT-3 175B, t = 8, in units of s b h: Table 2's rows as numbers (5 a s / h = 80 exactly).
    No parallelism 114; tensor parallel 10 + 24/8 + 80/8 = 23, with sequence parallelism 114/8;
    selective 13 and 34/8; full recomputation 2 (the input replicated over the t ranks) and 2/8
    (sharded along the sequence)."""
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    sbh = s * b * h
    rows = {
        (1, False, "none"): 34 + 80,
        (t, False, "none"): 10 + 24 / 8 + 80 / 8,
        (t, True, "none"): (34 + 80) / 8,
        (t, False, "selective"): 10 + 24 / 8,
        (t, True, "selective"): 34 / 8,
        (t, False, "full"): 2,
        (t, True, "full"): 2 / 8,
    }
    for (degree, sp, recompute), units in rows.items():
        got = activation_bytes_per_layer(
            s, b, h, a, t=degree, sequence_parallel=sp, recompute=recompute
        )
        assert got / sbh == pytest.approx(units, rel=1e-12), (degree, sp, recompute)


def test_the_no_recomputation_branches_of_time_and_flops():
    """Narayanan et al. 2021, equations (3) and (4), the branch without recomputation: the
    backward pass is twice the forward, so 3 passes of 2 FLOPs per multiply-add (72 B s l h^2,
    the logit layer's V/(12 l h) term) against 4 with recomputation (96, V/(16 l h)); days 6 T P
    / (n X) against 8 T P / (n X). Counted here for GPT-3 175B (l 96, h 12288, V 51200, s 2048)."""
    from tessera.plan.formulas import flops_per_iteration, flops_per_token, training_days

    s, l, h, V = 2048, 96, 12288, 51200  # noqa: E741 - the paper's symbol
    forward = 24 * s * l * h**2 * (1 + s / (6 * h) + V / (12 * l * h))  # one sequence's forward
    logits = 2 * s * h * V  # the logit layer's forward, never recomputed
    assert flops_per_iteration(1, s, l, h, V, recompute=False) == pytest.approx(3 * forward)
    # with recomputation: one more forward of everything but the logit layer
    assert flops_per_iteration(1, s, l, h, V) == pytest.approx(4 * forward - logits)
    assert flops_per_token(s, l, h, V) == pytest.approx(3 * forward / s)  # MFU's: no recompute
    assert flops_per_token(s, l, h, V, recompute=True) == pytest.approx((4 * forward - logits) / s)
    tokens, params, n, rate = 300e9, 175e9, 1024, 140e12
    assert training_days(tokens, params, n, rate, recompute=False) == pytest.approx(
        6 * tokens * params / (n * rate) / 86400
    )
    assert training_days(tokens, params, n, rate) == pytest.approx(
        8 * tokens * params / (n * rate) / 86400
    )
