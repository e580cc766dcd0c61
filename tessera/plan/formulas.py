"""The closed forms the planner adds up, each from the paper that derived it (pure arithmetic).

Symbols as in the papers: Ψ (or P) parameters, N_d data-parallel ranks, K optimizer bytes per
parameter, s sequence length, b micro-batch, B global batch (sequences), h hidden size, a heads,
l layers, V vocabulary, t tensor-parallel size, p pipeline stages, m micro-batches, v model
chunks per device (interleaved schedule). /work/shared/FORMULAS.md lists them with the same
sources.
"""

from __future__ import annotations

from tessera.zero.memory import estimate_memory

__all__ = [
    "RECOMPUTE",
    "activation_bytes_per_layer",
    "bubble_fraction",
    "bubble_fraction_on_shared_cores",
    "flops_per_iteration",
    "flops_per_token",
    "gpt_params",
    "largest_model",
    "model_state_bytes",
    "training_days",
]

RECOMPUTE = ("none", "selective", "full")
"""Activation recomputation variants of Korthikanti et al. 2022."""


def model_state_bytes(
    num_params: int,
    dp: int,
    stage: int,
    *,
    param_bytes: int = 2,
    grad_bytes: int = 2,
    optimizer_bytes: int = 12,
) -> dict[str, int]:
    """Model-state bytes per rank: ZeRO's (2Ψ + 2Ψ + KΨ) split by stage over N_d = `dp` ranks.

    Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
    (SC 2020), section 3 and figure 1: stage 0 (2+2+K)Ψ, stage 1 2Ψ + 2Ψ + KΨ/N_d, stage 2
    2Ψ + (2+K)Ψ/N_d, stage 3 (2+2+K)Ψ/N_d; K = 12 for mixed-precision Adam (fp32 master
    weights, momentum, variance). Plain fp32 Adam: 4-byte parameters and gradients, K = 8.
    Reuses `tessera.zero.estimate_memory` (one formula, one place).
    """
    return estimate_memory(
        num_params,
        dp,
        stage,
        param_bytes=param_bytes,
        grad_bytes=grad_bytes,
        optimizer_bytes=optimizer_bytes,
    )


def largest_model(
    memory_bytes: float, dp: int, stage: int, *, mp: int = 1, optimizer_bytes: int = 12
) -> float:
    """The most parameters whose model states fit `memory_bytes` per device (no activations).

    ZeRO (Rajbhandari et al. 2020), section 5.1 and table 2 ("max theoretical model size"): with
    model parallelism of degree `mp` each device holds 1/mp of the model, and the model states
    per parameter are those of `model_state_bytes` for the stage; so Ψ_max = mp M / (bytes per
    parameter).
    """
    per_param = model_state_bytes(10**12, dp, stage, optimizer_bytes=optimizer_bytes)["total"]
    return mp * memory_bytes / (per_param / 10**12)


def activation_bytes_per_layer(
    s: int,
    b: int,
    h: int,
    a: int,
    *,
    t: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
) -> float:
    """16-bit activation bytes one transformer layer keeps for its backward pass.

    Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (2022),
    section 4 (equations 1-2) and section 5: without parallelism s b h (34 + 5 a s / h); with
    tensor parallelism s b h (10 + 24/t + 5 a s / (h t)) (layer norms and dropouts are
    replicated); with tensor + sequence parallelism s b h (34 + 5 a s / h) / t. Selective
    recomputation (attention's softmax, dropout and score products recomputed) drops the
    5 a s / h term; full recomputation keeps only each layer's input, 2 s b h (divided by t
    when sequence parallelism shards it).
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    sbh = float(s) * b * h
    if recompute == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    attention = 0.0 if recompute == "selective" else 5 * a * s / h
    if t == 1 or sequence_parallel:
        return sbh * (34 + attention) / t
    return sbh * (10 + 24 / t + attention / t)


def gpt_params(l: int, h: int, V: int, s: int) -> float:  # noqa: E741 - the paper's symbol
    """Parameters of a GPT: P = 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h)).

    Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
    Megatron-LM" (SC 2021), section 5.1, equation (2): per layer 12h^2 of weights and 13h of
    biases and layer norms, plus the (tied) token embedding V h and position embedding s h.
    """
    return 12 * l * h**2 * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))


def flops_per_iteration(
    B: int,
    s: int,
    l: int,  # noqa: E741 - the paper's symbol
    h: int,
    V: int,
    *,
    recompute: bool = True,
) -> float:
    """FLOPs of one training iteration of B sequences (matrix multiplications only).

    Narayanan et al. 2021, section 5.1 and appendix, equation (3): with full activation
    recomputation (one extra forward pass) F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)); without
    it the backward pass is twice the forward and F = 72 B s l h^2 (1 + s/(6h) + V/(12 l h))
    (the logit layer is never recomputed, hence the different last term).
    """
    if recompute:
        return 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))
    return 72 * B * s * l * h**2 * (1 + s / (6 * h) + V / (12 * l * h))


def flops_per_token(
    s: int,
    l: int,  # noqa: E741 - the paper's symbol
    h: int,
    V: int,
    *,
    recompute: bool = False,
) -> float:
    """Model FLOPs per trained token: `flops_per_iteration` of one sequence over its s tokens.

    MFU (Chowdhery et al. 2022, PaLM, appendix B) counts the model's FLOPs without
    recomputation: pass recompute=False (the default) for it, True for hardware FLOPs.
    """
    return flops_per_iteration(1, s, l, h, V, recompute=recompute) / s


def bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """Pipeline bubble time over ideal compute time: (p - 1) / (v m).

    Narayanan et al. 2021, section 2.2: GPipe and 1F1B both idle (p - 1)/m of the ideal time;
    the interleaved schedule with v model chunks per device cuts it to (p - 1)/(v m).
    """
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"p, m and v must be at least 1, got p={p}, m={m}, v={v}")
    return (p - 1) / (v * m)


def bubble_fraction_on_shared_cores(p: int, m: int, replicas: int, cores: int) -> float:
    """The bubble of `replicas` pipelines of p stages and m micro-batches whose p x replicas
    processes share `cores` cores (one thread each), over the compute time at the rate they
    reach when all of them compute at once.

    Why: on dedicated devices a stage that waits leaves its device idle, and the bubble is
    (p - 1)/m (`bubble_fraction`). Processes on shared cores give their core to the others while
    they wait (tessera's pipeline links sleep in poll(), they do not spin): in a slot of the
    schedule where only k stages of each pipeline compute, they run max(1, k x replicas / cores)
    times slower than alone, not the max(1, p x replicas / cores) of the all-busy rate. Slot j
    of a sweep (j = 1 .. m + p - 1; GPipe's forward or backward, and 1F1B's ramps, alike) has
    k_j = min(j, p, m, m + p - j) stages busy; summed over the slots, against m slots at the
    all-busy rate. With cores >= p x replicas this is (p - 1)/m, as it should be.
    """
    if min(p, m, replicas, cores) < 1:
        raise ValueError(
            f"p, m, replicas and cores must be at least 1 ({p}, {m}, {replicas}, {cores})"
        )
    all_busy = max(1.0, p * replicas / cores)
    slots = sum(
        max(1.0, min(j, p, m, m + p - j) * replicas / cores) / all_busy for j in range(1, m + p)
    )
    return slots / m - 1


def training_days(
    tokens: float, params: float, devices: int, flops_per_device: float, *, recompute: bool = True
) -> float:
    """End-to-end training time in days: 8 T P / (n X), 6 T P / (n X) without recomputation.

    Narayanan et al. 2021, section 5.1, equation (4): T tokens, P parameters, n devices at X
    FLOP/s each (the s/(6h) and V/(16lh) terms of equation (3) dropped, as they are small).
    """
    factor = 8 if recompute else 6
    return factor * tokens * params / (devices * flops_per_device) / 86400
