"""A torchvision v2 augmentation as a pipeline map, for ``tests/test_vision_torchvision.py``
(module level, so spawn workers import it; torchvision is imported on first use)."""

from __future__ import annotations

import numpy as np

_AUGMENT: dict = {}


def make_image(i):
    """A 32x32 RGB image of its own (uint8, HWC) and its id."""
    pixels = np.random.default_rng(i).integers(0, 256, size=(32, 32, 3), dtype=np.uint8)
    return {"id": i, "image": pixels}


def _augment():
    if "t" not in _AUGMENT:
        from torchvision.transforms import v2

        _AUGMENT["t"] = v2.Compose([
            v2.RandomResizedCrop(16, antialias=True),
            v2.RandomHorizontalFlip(),
            v2.ColorJitter(brightness=0.4, contrast=0.4, saturation=0.4, hue=0.1),
        ])
    return _AUGMENT["t"]


def augment(s):
    """RandomResizedCrop, RandomHorizontalFlip and ColorJitter: every random choice drawn
    from torch's global generator, as torchvision's transforms draw them."""
    import torch

    image = torch.from_numpy(s["image"]).permute(2, 0, 1)
    return {"id": s["id"], "image": _augment()(image).permute(1, 2, 0).contiguous().numpy()}
