"""A source with a columnar read whose batches fail to collate at one sample (module
level: spawn workers import it)."""

from __future__ import annotations

import numpy as np

from zephon.pipeline.sources.base import Source

BAD = 137


class RefusingColumns(Source):
    """400 samples ``{"x": [i] * 4}``; the columnar read refuses a batch holding
    :data:`BAD` (the row-wise read then names the sample), and :func:`refusing_collate`
    refuses to collate it."""

    name = "grp"

    def __len__(self) -> int:
        return 400

    def get(self, i):
        return {"x": np.full(4, i)}

    def get_batch(self, indices):
        if BAD in list(indices):
            raise RuntimeError(f"the columnar read refuses {BAD}")
        return {"x": np.stack([np.full(4, i) for i in indices])}

    def sample_nbytes(self) -> float:
        return 32.0


def refusing_collate(values):
    xs = [v["x"] for v in values]
    if any(int(x[0]) == BAD for x in xs):
        raise ValueError(f"collate refuses {BAD}")
    return {"x": np.stack(xs)}
