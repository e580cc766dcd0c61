"""A tied model built on the meta device under ZeRO-3 equals the model built whole, bit for bit.

`TiedLM` (not a tessera model) ties its LM head to its embedding the Hugging Face way
(`head.weight = embed.weight`): built whole, the tied matrix keeps the embedding's N(0, 1)
values and the head's own Kaiming draw is dropped. Materialised on the meta device it must keep
the same values (not the head's init, which the walk also runs) and every other tensor must
equal the whole model's too (the head's draw still advances the random stream in the same way).
Checked through `tessera.setup(..., strategy="zero3")` on 2 ranks (with and without
`offload="cpu"`), and through the trainer
(`--strategy zero3` builds on the meta device by default) against `--no-meta-init`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import tessera
from tessera.zero import OffloadPolicy

VOCAB, WIDTH, SEED = 11, 6, 7


class TiedLM(nn.Module):
    """Embedding, two blocks, and a head that shares the embedding's matrix."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(h)


def tied_lm() -> nn.Module:
    """`--model` factory."""
    return TiedLM()


def tokens() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`--data` factory: next-token pairs of a fixed random sequence."""
    ids = torch.randint(0, VOCAB, (65 * 5,), generator=torch.Generator().manual_seed(2))
    rows = ids.view(65, 5)
    return [(row[:-1], row[1:]) for row in rows]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """`--loss`: cross-entropy over every position."""
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def _ranks() -> list[dict[str, torch.Tensor]]:
    """Materialised without and with `offload="cpu"` (the host keeps the fp32 shards)."""
    states = []
    for options in ({}, {"offload": OffloadPolicy(device="cpu")}):
        torch.manual_seed(SEED)
        with torch.device("meta"):
            model = TiedLM()
        engine = tessera.setup(
            model, lambda ps: torch.optim.AdamW(ps, lr=1e-2), strategy="zero3", loss_fn=lm_loss,
            **options,
        )  # fmt: skip
        states.append(engine.full_state_dict())
        engine.close()
    return states


def test_a_tied_meta_model_equals_the_model_built_whole(run_ranks):
    torch.manual_seed(SEED)
    whole = TiedLM().state_dict()
    assert torch.equal(whole["head.weight"], whole["embed.weight"])
    for states in run_ranks(_ranks, 2):
        for materialised in states:
            assert list(materialised) == list(whole)
            for key, value in whole.items():
                assert torch.equal(materialised[key], value), key


def test_the_trainer_gives_a_tied_model_the_same_losses_on_the_meta_device(tmp_path):
    from tessera.train import build_config, run_training
    from tessera.train.metrics import read_metrics

    losses: dict[bool, Any] = {}
    for meta in (True, False):
        config = {
            "model_factory": "test_zero3_tied:tied_lm", "data": "test_zero3_tied:tokens",
            "loss": "test_zero3_tied:lm_loss", "batch_size": 8, "progress": False,
            "warmup_steps": 1, "strategy": "zero3", "nproc": 1, "steps": 2, "log_every": 1,
            "meta_init": meta, "seed": SEED, "out": str(tmp_path / str(meta)),
        }  # fmt: skip
        run_training(build_config(config, {}))
        losses[meta] = [r["loss"] for r in read_metrics(tmp_path / str(meta) / "metrics.jsonl")]
    assert len(losses[True]) == 2 and losses[True] == losses[False]
