"""MixtureReadConfig: how a mixture source lays its components out in an epoch.

The shares themselves are the mixture's weights (``sources.mixture``): an epoch
holds exactly each component's rounded share whatever the mode. The mode decides
where those positions fall: the smooth round robin spreads each component evenly
over the epoch, the weighted random mode places them by a seeded bijection (a new
one per epoch). ``within_component`` says whether a component's first pass is read
in its own order or a seeded one (every later pass has a seeded order of its own).
Both are deterministic functions of ``seed``, the weights and the sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

from zephon.options._spec import Int, OptionsBase, Str, option, option_class
from zephon.options.limits import MAX_SEED

__all__ = ["MIXTURE_MODES", "WITHIN_COMPONENT_MODES", "MixtureReadConfig"]

MIXTURE_MODES = ("weighted_round_robin", "weighted_random")
WITHIN_COMPONENT_MODES = ("as_is", "shuffle")


@option_class
@dataclass(frozen=True, slots=True, kw_only=True)
class MixtureReadConfig(OptionsBase):
    """Read policy of ``sources.mixture``: how the component schedule is drawn.

    Give it to ``sources.mixture(..., config=...)``, or as
    ``RuntimeOptions(mixture_config=...)`` for every mixture without its own.

    Examples:
        >>> cfg = zephon.MixtureReadConfig(mode="weighted_random", seed=7)
        >>> a = sources.from_sequence([0, 1, 2], name="a")
        >>> b = sources.from_sequence([10, 11, 12], name="b")
        >>> sorted(sources.mixture({"a": a, "b": b}, config=cfg).get(i) for i in range(6))
        [0, 1, 2, 10, 11, 12]
    """

    mode: str = option(
        "weighted_round_robin", check=Str(choices=MIXTURE_MODES),
        doc="weighted_round_robin: each component spread evenly over the epoch (a search of "
            "O(K log L) per position for K components); weighted_random: positions placed "
            "by a seeded bijection per epoch (O(1) per position: the choice for many "
            "components).",
    )
    seed: int = option(
        0, check=Int(min=0, max=MAX_SEED),
        doc="Seed of the component schedule and of within-component shuffles (an unsigned "
            "64-bit int: it travels in checkpoints).",
    )
    within_component: str = option(
        "as_is", check=Str(choices=WITHIN_COMPONENT_MODES),
        doc="as_is: a component's first pass in its own order; shuffle: in a seeded order. "
            "Every later pass (a repeat) has a seeded order of its own.",
    )
