"""Batches onto a device, and image columns normalised there.

Owned here: :class:`Placement`, what ``zephon.torch.loader(device=..., normalize=...)``
does to each batch after it became tensors (and after pinning): the arguments checked
once (:func:`placement`, a :class:`~zephon.errors.ZephonConfigError` naming the
argument), every tensor of the batch moved to the device, then each named image column
turned into the float tensor a vision model takes.

Why on the device: image batches cross processes and the host-to-device link as
``uint8``, four times fewer bytes than ``float32``; the conversion is one pass over
the batch where it is cheapest (a GPU), after the copy.

Normalisation, torchvision's convention: ``normalize={"image": (mean, std)}`` with
``mean`` and ``std`` per channel in 0-1 units (``mean=(0.485, 0.456, 0.406)``,
``std=(0.229, 0.224, 0.225)`` for ImageNet models), applied to a ``uint8`` column as
``(x / 255 - mean) / std`` (computed as ``x * (1 / (255 * std)) - mean / std`` in
float32: two passes, equal to the textbook formula within float32 rounding). The
pipeline's images are ``layout="HWC"`` (what decoders make: height, width, channels;
a batch is ``(N, H, W, C)``) or ``"CHW"``; ``(H, W)`` images are one channel. The
layout names are those of the decode op's ``layout=``. The result is always
``(N, C, H, W)`` float32, as torchvision models take it: contiguous, or with
``channels_last=True`` in ``torch.channels_last`` memory format (from HWC images
that costs no transposition at all, and convolutions under autocast run faster in it).
Values outside ``[0, 1]`` for ``mean`` or ``(0, 1]`` for ``std`` are refused: they are
0-255 units, the most common slip.

Streams (CUDA): the loader with ``pin_memory=True`` prepares batches on its background
thread: there :meth:`Placement.move` issues the copies (``non_blocking`` from pinned
memory) and the normalisation on a side stream of the device and records an event;
the consumer's thread, when it takes the batch, makes its current stream wait on that
event and marks every tensor of the batch as used by that stream
(``Tensor.record_stream``), so the caching allocator does not hand their memory to the
next batch while the training step still reads them (:meth:`Placement.ready`). Copy
and conversion thus overlap the training step. Without ``pin_memory`` the move runs
in the consumer's thread on its current stream and needs no event. Elsewhere (the CPU,
or a device without CUDA streams) moves are plain ``Tensor.to`` calls.

Lifecycle: a Placement belongs to one loader; its side stream and the per-channel
constants on the device are made on first use and kept.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Iterator, Mapping

from zephon.errors import ZephonConfigError
from zephon.torch._convert import map_leaves

__all__ = ["LAYOUTS", "Placement", "placement"]

#: the layouts of the pipeline's image batches
LAYOUTS = ("HWC", "CHW")


def _channels(value: Any, what: str) -> tuple[float, ...]:
    """``mean`` or ``std`` as a tuple of finite floats (a number is one value)."""
    items = [value] if isinstance(value, numbers.Real) else value
    try:
        out = tuple(float(v) for v in items if isinstance(v, numbers.Real)
                    and not isinstance(v, bool))
        ok = len(out) == len(items) and len(out) > 0 and all(map(math.isfinite, out))
    except TypeError:
        ok = False
    if not ok:
        raise ZephonConfigError(f"normalize: {what} must be a finite number or a non-empty "
                                f"sequence of them (one per channel), got {value!r}",
                                field="loader.normalize")
    return out


def _check_pair(field: Any, pair: Any) -> tuple[tuple[float, ...], tuple[float, ...]]:
    if not isinstance(field, str):
        raise ZephonConfigError(f"normalize: keys are column names (str), got {field!r}",
                                field="loader.normalize")
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
        raise ZephonConfigError(f"normalize[{field!r}] must be a pair (mean, std), got "
                                f"{pair!r}", field="loader.normalize")
    mean = _channels(pair[0], f"normalize[{field!r}] mean")
    std = _channels(pair[1], f"normalize[{field!r}] std")
    if len(mean) != len(std) and 1 not in (len(mean), len(std)):
        raise ZephonConfigError(f"normalize[{field!r}]: {len(mean)} means and {len(std)} "
                                f"stds; give one per channel (or one for all)",
                                field="loader.normalize")
    if not all(0.0 <= m <= 1.0 for m in mean) or not all(0.0 < s <= 1.0 for s in std):
        raise ZephonConfigError(
            f"normalize[{field!r}] = (mean={mean}, std={std}): mean and std are in 0-1 "
            f"units (applied after dividing the uint8 values by 255, as torchvision's "
            f"ToTensor + Normalize), so mean lies in [0, 1] and std in (0, 1]; for 0-255 "
            f"figures divide them by 255 (ImageNet: mean=(0.485, 0.456, 0.406), "
            f"std=(0.229, 0.224, 0.225))", field="loader.normalize")
    return mean, std


def _check_device(torch, device: Any):
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ZephonConfigError(f"device must be a torch.device, a string such as 'cuda:0' "
                                f"or 'cpu', or a device index; got {device!r} ({exc})",
                                field="loader.device") from None
    if dev.type == "cpu":
        return dev
    backend = getattr(torch, dev.type, None)
    available = getattr(backend, "is_available", None)
    if available is not None and not available():
        raise ZephonConfigError(f"device={device!r}: torch.{dev.type}.is_available() is False "
                                f"on this machine; give device='cpu' or None (batches stay on "
                                f"the host)", field="loader.device")
    count = getattr(backend, "device_count", None)
    if dev.index is not None and count is not None and dev.index >= count():
        raise ZephonConfigError(f"device={device!r}: this machine has {count()} {dev.type} "
                                f"device(s)", field="loader.device")
    return dev


def placement(torch, device: Any, non_blocking: Any, normalize: Any, layout: Any,
              channels_last: Any) -> "Placement | None":
    """The checked :class:`Placement` of the loader's arguments, or None when they ask
    for nothing (no device, no normalisation)."""
    for flag, value in (("non_blocking", non_blocking), ("channels_last", channels_last)):
        if not isinstance(value, bool):
            raise ZephonConfigError(f"{flag} must be True or False, got {value!r}",
                                    field=f"loader.{flag}")
    if layout not in LAYOUTS:
        raise ZephonConfigError(f"layout must be one of {LAYOUTS} (the layout of each "
                                f"image the pipeline makes), got {layout!r}",
                                field="loader.layout")
    if normalize is not None and not isinstance(normalize, Mapping):
        raise ZephonConfigError(f"normalize must be None or a mapping column -> (mean, std), "
                                f"such as {{'image': ((0.485, 0.456, 0.406), (0.229, 0.224, "
                                f"0.225))}}; got {type(normalize).__name__}",
                                field="loader.normalize")
    spec = {field: _check_pair(field, pair) for field, pair in (normalize or {}).items()}
    dev = None if device is None else _check_device(torch, device)
    if dev is None and not spec:
        return None
    return Placement(torch, dev, non_blocking, spec, layout, channels_last)


def _tensors(value, torch) -> Iterator[Any]:
    """Every tensor in a batch, through its structure."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v, torch)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v, torch)


class Placement:
    """What the loader does to a batch of tensors: moved to ``device`` (None: left where it
    is) and ``spec``'s columns normalised (see the module docstring)."""

    def __init__(self, torch, device, non_blocking: bool, spec: dict, layout: str,
                 channels_last: bool) -> None:
        self.torch, self.device, self.non_blocking = torch, device, non_blocking
        self.spec, self.layout, self.channels_last = spec, layout, channels_last
        self.streams = device is not None and device.type == "cuda"
        self._stream = None
        self._constants: dict = {}  # (field, channels, device) -> (scale, shift)

    # -- the consumer's thread, no prefetch -----------------------------------------------
    def now(self, batch):
        """``batch`` moved and normalised on the current stream (usable at once)."""
        return self._normalized(self._moved(batch))

    # -- the prefetching thread, then the consumer's -----------------------------------------
    def move(self, batch) -> tuple[Any, Any]:
        """``(batch, event)``: the copies and the normalisation issued; with CUDA on a side
        stream, ``event`` marking their end (else None: the batch is ready)."""
        if not self.streams:
            return self.now(batch), None
        torch = self.torch
        with torch.cuda.device(self.device):
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.device)
            with torch.cuda.stream(self._stream):
                out = self._normalized(self._moved(batch))
                event = torch.cuda.Event()
                event.record(self._stream)
        return out, event

    def ready(self, batch, event):
        """``batch`` made safe for the consumer's current stream: it waits for ``event``,
        and the allocator keeps the tensors' memory until that stream is done with them."""
        if event is None:
            return batch
        current = self.torch.cuda.current_stream(self.device)
        current.wait_event(event)
        for tensor in _tensors(batch, self.torch):
            if tensor.device.type == "cuda":
                tensor.record_stream(current)
        return batch

    # -- the work -------------------------------------------------------------------------------
    def _moved(self, batch):
        if self.device is None:
            return batch
        torch, dev, nb = self.torch, self.device, self.non_blocking
        return map_leaves(batch, lambda v: v.to(dev, non_blocking=nb)
                          if isinstance(v, torch.Tensor) else v)

    def _normalized(self, batch):
        if not self.spec:
            return batch
        if not isinstance(batch, dict):
            raise ZephonConfigError(f"normalize names columns, but the pipeline's batches are "
                                    f"{type(batch).__name__}s, not dicts of columns",
                                    field="loader.normalize")
        for field in self.spec:
            if field not in batch:
                raise ZephonConfigError(f"normalize names the column {field!r}, which the "
                                        f"batch does not have (it has {sorted(batch)})",
                                        field="loader.normalize")
            batch[field] = self._image(field, batch[field])
        return batch

    def _image(self, field: str, x):
        torch = self.torch
        if not isinstance(x, torch.Tensor) or x.dtype != torch.uint8:
            what = f"a {x.dtype} tensor" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ZephonConfigError(f"normalize[{field!r}] takes uint8 images (0-255), the "
                                    f"column is {what}; leave the column uint8 (decode to "
                                    f"uint8) or normalise it in a map op",
                                    field="loader.normalize")
        x = self._nchw(field, x)
        scale, shift = self._constants_for(field, x.shape[1], x.device)
        fmt = torch.channels_last if self.channels_last else torch.contiguous_format
        out = x.to(dtype=torch.float32, memory_format=fmt)
        return out.mul_(scale).add_(shift)

    def _nchw(self, field: str, x):
        if x.dim() == 3:  # (N, H, W): one channel
            return x.unsqueeze(1)
        if x.dim() != 4:
            raise ZephonConfigError(f"normalize[{field!r}]: image batches are (N, H, W, C), "
                                    f"(N, C, H, W) or (N, H, W); the column has shape "
                                    f"{tuple(x.shape)}", field="loader.normalize")
        return x.permute(0, 3, 1, 2) if self.layout == "HWC" else x

    def _constants_for(self, field: str, channels: int, device):
        key = (field, channels, str(device))
        found = self._constants.get(key)
        if found is not None:
            return found
        mean, std = self.spec[field]
        if len(mean) not in (1, channels) or len(std) not in (1, channels):
            raise ZephonConfigError(
                f"normalize[{field!r}]: {len(mean)} means and {len(std)} stds for images of "
                f"{channels} channel(s) (layout={self.layout!r}: is it the images' layout?)",
                field="loader.normalize")
        mean = mean * channels if len(mean) == 1 else mean
        std = std * channels if len(std) == 1 else std
        torch = self.torch
        scale = torch.tensor([1.0 / (255.0 * s) for s in std], dtype=torch.float32)
        shift = torch.tensor([-m / s for m, s in zip(mean, std, strict=True)],
                             dtype=torch.float32)
        found = (scale.view(1, channels, 1, 1).to(device),
                 shift.view(1, channels, 1, 1).to(device))
        self._constants[key] = found
        return found
