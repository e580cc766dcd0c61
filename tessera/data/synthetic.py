"""Deterministic synthetic data sets for the MLP and CNN: no download, same bytes everywhere.

Everything is drawn from one ``torch.Generator`` seeded by ``seed`` on the CPU, so a data set
is a pure function of its arguments: every rank can build the full set locally and the sharding
helpers pick its part, with no broadcast needed.
"""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

__all__ = ["make_classification", "make_images"]


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")


def make_classification(
    num_samples: int,
    num_features: int,
    num_classes: int,
    *,
    seed: int,
    class_sep: float = 2.0,
    noise: float = 1.0,
) -> TensorDataset:
    """Gaussian blobs: one random centre per class, plus isotropic Gaussian noise.

    Returns a ``TensorDataset`` of features ``(N, num_features)`` float32 and labels ``(N,)``
    int64. ``class_sep`` scales the centres (larger is easier); ``noise`` is the noise std.
    """
    _check_positive(num_samples=num_samples, num_features=num_features, num_classes=num_classes)
    generator = torch.Generator().manual_seed(seed)
    centres = class_sep * torch.randn(num_classes, num_features, generator=generator)  # (K, F)
    labels = torch.randint(num_classes, (num_samples,), generator=generator)  # (N,)
    noise_values = torch.randn(num_samples, num_features, generator=generator)  # (N, F)
    features = centres[labels] + noise * noise_values  # (N, F)
    return TensorDataset(features.float(), labels.long())


def make_images(
    num_samples: int,
    *,
    channels: int = 1,
    size: int = 8,
    num_classes: int = 10,
    seed: int,
    noise: float = 0.5,
) -> TensorDataset:
    """Small images: a fixed random +-1 pattern per class plus Gaussian noise.

    Returns a ``TensorDataset`` of images ``(N, channels, size, size)`` float32 and labels
    ``(N,)`` int64. The patterns are local textures, so a conv net separates them well while a
    per-pixel mean does not, which makes the CNN's loss curve meaningful.
    """
    _check_positive(num_samples=num_samples, channels=channels, size=size, num_classes=num_classes)
    generator = torch.Generator().manual_seed(seed)
    signs = torch.randint(2, (num_classes, channels, size, size), generator=generator)
    patterns = 2.0 * signs.float() - 1.0  # (K, C, S, S), entries in {-1, +1}
    labels = torch.randint(num_classes, (num_samples,), generator=generator)  # (N,)
    noise_values = torch.randn(num_samples, channels, size, size, generator=generator)
    images = patterns[labels] + noise * noise_values  # (N, C, S, S)
    return TensorDataset(images.float(), labels.long())
