"""`tessera train --strategy pipeline`: equal to a plain PyTorch loop written here, and resumed
bit for bit with AdamW."""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F

from tessera.data import CharTokenizer, LMBatches, load_corpus
from tessera.models import GPT, GPTConfig
from tessera.train import build_config, latest_checkpoint, load_checkpoint, run_training

TINY = {
    "model": {"n_layer": 2, "n_embd": 32, "n_head": 2, "block_size": 32},
    "batch_size": 8,
    "corpus_bytes": 50_000,
    "sample_tokens": 0,
    "progress": False,
    "lr": 0.05,
    "warmup_steps": 2,  # steps 0-1 warm up, steps 2-3 decay: both branches of the schedule
    "decay_steps": 4,
    "grad_clip": 0.5,
}
STEPS = 4


def _lr(step: int) -> float:
    """The schedule as documented: linear warmup to lr, then cosine to lr / 10."""
    lr, warmup, decay = TINY["lr"], TINY["warmup_steps"], TINY["decay_steps"]
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / decay)
    return lr / 10 + 0.5 * (lr - lr / 10) * (1 + math.cos(math.pi * progress))


def _oracle(dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], int]:
    """One process, the whole global batch, SGD (momentum 0.9) with torch's own clipping.

    Returns the final state and how many steps clipping acted (the test needs it to act)."""
    text = load_corpus("stdlib", max_bytes=TINY["corpus_bytes"])
    tokenizer = CharTokenizer.from_text(text)
    tokens = tokenizer.encode_tensor(text)
    batches = LMBatches(
        tokens[: int(tokens.numel() * 0.9)],  # the trainer holds out the corpus's last tenth
        block_size=32,
        global_batch_size=TINY["batch_size"],
    )
    torch.manual_seed(0)  # the trainer's seed: the same initial weights
    model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, **TINY["model"])).to(dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=TINY["lr"], momentum=0.9)
    clipped = 0
    for step in range(STEPS):
        x, y = batches.batch(step)  # the whole global batch
        logits = model(x)
        F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), TINY["grad_clip"])
        clipped += int(norm > TINY["grad_clip"])
        for group in optimizer.param_groups:
            group["lr"] = _lr(step)
        optimizer.step()
        optimizer.zero_grad()
    return copy.deepcopy(model.state_dict()), clipped


def _checkpoint(run_dir):
    return load_checkpoint(latest_checkpoint(run_dir))["engine"]


def test_pipeline_strategy_equals_a_plain_loop(tmp_path):
    split = {"strategy": "pipeline", "nproc": 2}
    # SGD: attention key biases have a true gradient of zero, which Adam would amplify
    sgd = {**TINY, "optimizer": "sgd", "steps": STEPS}
    run_training(build_config(sgd, {**split, "out": str(tmp_path / "sgd")}))
    got = _checkpoint(tmp_path / "sgd")["model"]
    want, clipped = _oracle(torch.float32)
    want64, _ = _oracle(torch.float64)
    assert clipped > 0  # max_norm small enough that clipping acted
    assert got.keys() == want.keys()
    for name in want:
        err = (got[name].double() - want64[name]).abs().max().item()
        oracle_err = (want[name].double() - want64[name]).abs().max().item()
        # factor 4: micro-batch accumulation and the tied-embedding sum reorder the float32
        # sums, each at most doubling the oracle's own rounding; floor: one rounding per term of
        # a weight gradient's sum over 8 x 32 tokens, per step
        floor = STEPS * 8 * 32 * torch.finfo(torch.float32).eps * want64[name].abs().max().item()
        assert err <= 4 * oracle_err + floor, (name, err, oracle_err)
    # Resume with AdamW, bit for bit: tests/test_resume.py (every strategy, pipeline included).
