"""A small decoder-only transformer (GPT-2 style) for character-level language modelling.

Written in the spirit of nanoGPT: pre-LayerNorm blocks of causal self-attention and a 4x GELU
MLP with residuals, learned position embeddings, and an output head tied to the token embedding
(Press & Wolf 2017). Initialisation follows GPT-2 (Radford et al. 2019): N(0, 0.02) everywhere,
with the projections that write into the residual stream scaled by 1/sqrt(2 * n_layer) so the
residual's variance does not grow with depth.

The initialisation is one function of one module, `GPT.init_module`, applied to every module in
`modules()` order, and construction itself draws no random numbers (torch.nn's default inits run
on a forked generator and are overwritten). So a GPT built on the meta device and initialised
module by module (ZeRO-3 with `init_fn=model.init_module`, `tessera.zero.materialize`) gets the
same weights as one built whole, on the same seed.

The blocks live in ``self.blocks`` (an ``nn.ModuleList``) and the forward pass is split into
:meth:`GPT.embed`, the blocks and :meth:`GPT.head`, so pipeline parallelism can cut the model
between blocks and ZeRO-3/FSDP can wrap each block on its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "GPTConfig", "Block", "CausalSelfAttention", "FeedForward"]


@dataclass(kw_only=True, frozen=True)
class GPTConfig:
    """Shape of a :class:`GPT`."""

    vocab_size: int
    """Number of token ids; required because it comes from the tokenizer, never a guess."""
    block_size: int = 128
    """Longest context the model accepts (number of learned position embeddings)."""
    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide ``n_embd``."""
    n_embd: int = 128
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout probability on embeddings, attention weights and residual branches."""
    bias: bool = True
    """Give Linear and LayerNorm layers a bias (GPT-2 does; False is slightly faster)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t only attends to positions <= t."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        # One matmul for query, key and value of all heads at once.
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        # Writes into the residual stream: gets the scaled GPT-2 init (see GPT.init_module).
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.proj_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend over ``x`` of shape ``(B, T, C)``; returns ``(B, T, C)``."""
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 x (B, T, C)
        # (B, T, C) -> (B, nh, T, hs): heads become a batch dimension.
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble heads: (B, T, C)
        return self.proj_dropout(self.proj(y))


class FeedForward(nn.Module):
    """Position-wise feed-forward: Linear to 4x width, GELU, Linear back."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.up = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.act = nn.GELU()
        # Writes into the residual stream: gets the scaled GPT-2 init.
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, T, C)`` -> ``(B, T, C)``."""
        return self.dropout(self.proj(self.act(self.up(x))))  # hidden is (B, T, 4C)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = FeedForward(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, T, C)`` -> ``(B, T, C)``."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token + position embeddings, ``n_layer`` blocks, final LayerNorm, tied lm_head."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        with torch.random.fork_rng():  # the layers' default inits draw nothing from the seed
            self.wte = nn.Embedding(config.vocab_size, config.n_embd)  # token embedding
            self.wpe = nn.Embedding(config.block_size, config.n_embd)  # position embedding
            self.drop = nn.Dropout(config.dropout)
            self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
            self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying: one matrix both embeds tokens and scores them; saves vocab * n_embd
        # parameters and helps small models. parameters() yields it once.
        self.lm_head.weight = self.wte.weight
        for module in self.modules():
            self.init_module(module)

    def init_module(self, module: nn.Module) -> None:
        """GPT-2's init of `module`'s own tensors: N(0, 0.02), residual projections scaled down
        by 1/sqrt(2 * n_layer), zero biases, unit LayerNorms; the head keeps the embedding's
        matrix (tied). A no-op on a meta-device module."""
        if isinstance(module, nn.Linear):
            if module is not self.lm_head:  # tied: the embedding initialises it
                std = 0.02
                if any(module is b.attn.proj or module is b.mlp.proj for b in self.blocks):
                    std = 0.02 / math.sqrt(2 * self.config.n_layer)
                nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            module.reset_parameters()

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids ``(B, T)`` -> residual stream ``(B, T, C)`` (first pipeline stage)."""
        T = idx.shape[1]
        if T > self.config.block_size:
            raise ValueError(
                f"sequence length {T} exceeds block_size {self.config.block_size}; "
                "crop the context to the last block_size tokens"
            )
        positions = torch.arange(T, device=idx.device)  # (T,)
        return self.drop(self.wte(idx) + self.wpe(positions))  # (B, T, C) + (T, C)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Residual stream ``(B, T, C)`` -> logits ``(B, T, vocab_size)`` (last pipeline stage)."""
        return self.lm_head(self.ln_f(x))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids ``(B, T)`` with ``T <= block_size`` -> logits ``(B, T, vocab_size)``.

        No loss here: the trainer computes it, so every strategy (including a pipeline whose
        last stage alone holds the logits) sees the same interface.
        """
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Append ``max_new_tokens`` sampled tokens to ``idx`` ``(B, T)``; returns ``(B, T + n)``.

        The context is cropped to the last ``block_size`` tokens. ``temperature=0`` picks the
        most likely token (greedy); ``top_k`` samples only among the k most likely. Pass a seeded
        ``generator`` for reproducible samples. Dropout is switched off while generating.
        """
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if top_k is not None and top_k <= 0:
            raise ValueError(f"top_k must be positive or None, got {top_k}")
        was_training = self.training
        self.eval()
        try:
            for _ in range(max_new_tokens):
                context = idx[:, -self.config.block_size :]  # (B, <=block_size)
                logits = self(context)[:, -1, :]  # (B, vocab): only the last position matters
                if temperature == 0:
                    next_id = logits.argmax(dim=-1, keepdim=True)  # (B, 1)
                else:
                    logits = logits / temperature
                    if top_k is not None:
                        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                        logits = logits.masked_fill(logits < kth, float("-inf"))
                    probs = F.softmax(logits, dim=-1)
                    next_id = torch.multinomial(probs, 1, generator=generator)  # (B, 1)
                idx = torch.cat([idx, next_id], dim=1)
        finally:
            self.train(was_training)
        return idx

    def num_parameters(self, *, exclude_position_embedding: bool = False) -> int:
        """Number of scalar parameters, counting the tied embedding/head matrix once.

        ``exclude_position_embedding`` mirrors the usual convention of reporting "non-embedding"
        size for scaling-law comparisons (the token matrix is kept: it is also the head).
        """
        total = sum(p.numel() for p in self.parameters())
        if exclude_position_embedding:
            total -= self.wpe.weight.numel()
        return total
