"""Image ops for training and evaluation: decode, crop and resize encoded images, doing
only the decode work the crop needs.

    from zephon.vision import RandomResizedCrop, CenterCrop, decode_image

    train = Pipeline(sources.image_folder("train/")).map(RandomResizedCrop(224))
    val = Pipeline(sources.image_folder("val/"), shuffle=False).map(CenterCrop(224))

- :class:`RandomResizedCrop`: torchvision's RandomResizedCrop + RandomHorizontalFlip on
  the sample's encoded image, every draw from ``ctx.rng`` (deterministic per sample).
- :class:`CenterCrop`: torchvision's Resize + CenterCrop (evaluation).
- :func:`decode_image`: the full RGB decode of encoded bytes.
- :func:`random_resized_crop_box`, :func:`resized_size`: the geometry alone.

What the package owns: :mod:`zephon.vision.ops` (the ops and their geometry) and
:mod:`zephon.vision.decode` (the decoders: DCT-scaled, row-limited JPEG decoding with
simplejpeg or Pillow, and Pillow for everything else; why, with measurements, in its
docstring). It imports only :mod:`zephon.errors` from zephon, and NumPy; Pillow and
simplejpeg (the ``vision`` extra) are imported on the first image, so ``import
zephon.vision`` works without them and a decode without them is an ImportError naming
the extra.
"""

from __future__ import annotations

from zephon.vision.decode import EXTRA_HINT, decode_image
from zephon.vision.ops import CenterCrop, RandomResizedCrop, random_resized_crop_box, resized_size

__all__ = ["EXTRA_HINT", "CenterCrop", "RandomResizedCrop", "decode_image",
           "random_resized_crop_box", "resized_size"]
