"""What the article's train.py imports besides the accelerator: a small segmentation-like
model and a data loader of synthetic images, so the script runs in seconds on a CPU.

The article's model and dataset (medical images) are its own; these stand in for them
with the same shapes of use: `model(inputs)` gives per-pixel class scores that
`F.cross_entropy(outputs, targets)` takes with integer masks.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

CLASSES = 3


class MedicalSegmentationModel(nn.Module):
    """A tiny fully convolutional network: 1-channel images in, CLASSES scores per pixel out."""

    def __init__(self, classes: int = CLASSES) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
            nn.Conv2d(8, classes, 1),
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images)


def get_dataloader(samples: int = 64, size: int = 16, batch_size: int = 16, seed: int = 0) -> DataLoader:
    """Synthetic images whose mask is learnable from the pixels: class = brightness band."""
    gen = torch.Generator().manual_seed(seed)
    images = torch.rand(samples, 1, size, size, generator=gen)
    masks = torch.clamp((images[:, 0] * CLASSES).long(), max=CLASSES - 1)
    return DataLoader(TensorDataset(images, masks), batch_size=batch_size, shuffle=True, generator=gen)
