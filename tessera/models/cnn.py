"""A small convolutional classifier: exercises BatchNorm buffers and conv weights.

BatchNorm matters for distributed tests: its running statistics are buffers, not parameters, so
a data-parallel strategy must broadcast (or deliberately not sync) them, and a checkpoint must
save them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["CNN", "CNNConfig"]


@dataclass(kw_only=True, frozen=True)
class CNNConfig:
    """Shape of a :class:`CNN`."""

    in_channels: int = 1
    """Channels of the input images (1 for grey-scale)."""
    image_size: int = 8
    """Height and width of the (square) input images."""
    channels: tuple[int, ...] = (16, 32)
    """Output channels of each conv block, in order; at least one."""
    num_classes: int = 10
    """Number of output logits."""
    batch_norm: bool = True
    """Put a BatchNorm2d after each conv (off gives a model with no buffers)."""

    def __post_init__(self) -> None:
        for name in ("in_channels", "image_size", "num_classes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        object.__setattr__(self, "channels", tuple(self.channels))
        if not self.channels or any(int(c) <= 0 for c in self.channels):
            raise ValueError(
                f"channels must be a non-empty list of positive ints, got {self.channels}"
            )


class CNN(nn.Module):
    """Blocks of conv3x3 (padding 1) + optional BatchNorm2d + ReLU + 2x2 max-pool, then a head.

    The max-pool is skipped once the feature map is smaller than 2x2, so any ``image_size`` works;
    global average pooling makes the head independent of the final spatial size.
    """

    def __init__(self, config: CNNConfig) -> None:
        super().__init__()
        self.config = config
        blocks: list[nn.Module] = []
        size, channels_in = config.image_size, config.in_channels
        for channels_out in config.channels:
            # With BatchNorm right after, the conv bias is redundant (BN subtracts the mean).
            blocks.append(
                nn.Conv2d(channels_in, channels_out, 3, padding=1, bias=not config.batch_norm)
            )
            if config.batch_norm:
                blocks.append(nn.BatchNorm2d(channels_out))
            blocks.append(nn.ReLU())
            if size >= 2:
                blocks.append(nn.MaxPool2d(2))
                size //= 2
            channels_in = channels_out
        self.features = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(channels_in, config.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map images ``(B, C, H, W)`` to logits ``(B, num_classes)``."""
        features = self.features(x)  # (B, C_last, H', W')
        pooled = self.pool(features).flatten(1)  # (B, C_last)
        return self.head(pooled)  # (B, num_classes)

    def num_parameters(self) -> int:
        """Number of scalar parameters (BatchNorm running statistics are buffers, not counted)."""
        return sum(p.numel() for p in self.parameters())
