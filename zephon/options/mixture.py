"""MixtureReadConfig: how a mixture source interleaves its components.

Both modes are deterministic functions of ``seed`` and the weights: the
weighted round-robin is a smooth (credit-based) schedule, the weighted random
mode draws components from a seeded generator. ``within_component`` says
whether each component is read in its own order or shuffled (seeded too).
"""

from __future__ import annotations

from dataclasses import dataclass

from zephon.options._spec import Bool, Int, OptionsBase, Str, option, option_class
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

    Example:
        >>> cfg = zephon.MixtureReadConfig(mode="weighted_random", seed=7)
        >>> a = sources.from_sequence([0, 1, 2], name="a")
        >>> b = sources.from_sequence([10, 11, 12], name="b")
        >>> sorted(sources.mixture({"a": a, "b": b}, config=cfg).get(i) for i in range(6))
        [0, 1, 2, 10, 11, 12]
    """

    mode: str = option(
        "weighted_round_robin", check=Str(choices=MIXTURE_MODES),
        doc="weighted_round_robin: smooth deterministic schedule; weighted_random: seeded draws.",
    )
    seed: int = option(
        0, check=Int(min=0, max=MAX_SEED),
        doc="Seed of the component schedule and of within-component shuffles (an unsigned "
            "64-bit int: it travels in checkpoints).",
    )
    precompute: bool = option(
        True, check=Bool(),
        doc="Compute the component schedule of an epoch up front (NumPy) instead of lazily.",
    )
    within_component: str = option(
        "as_is", check=Str(choices=WITHIN_COMPONENT_MODES),
        doc="as_is: each component in its own order; shuffle: a seeded permutation per epoch.",
    )
