"""Which sequences of the global batch each rank runs at each micro-step (pure arithmetic).

This is the contract every schedule is checked against, and it needs neither torch nor
numpy, so the checker can prove two schedules agree on the global batch without running
anything. `schedc.model.data.GlobalBatches` turns the same ids into token tensors.

Step `s` owns the global sequence ids ``s*S .. s*S + S - 1``. With `D` ranks, `B`
sequences per micro-step and ``k = S / (B*D)`` serial waves, wave `j` runs the contiguous
chunk ``[j*D*B, (j+1)*D*B)`` of the step, and rank `r` runs the `r`-th piece of it::

    S = 8, B = 1          one rank              two ranks
    positions:            j=0..7: [j]           j=0: r0 [0]  r1 [1]
                                                j=1: r0 [2]  r1 [3]  ...

So the world-`D` schedule visits the same sequences as the single-rank one, in the same
order when read wave by wave, rank by rank; only the grouping into serial steps differs.
"""

from __future__ import annotations


def micro_steps(S: int, B: int, D: int) -> int:
    """Serial micro-steps (waves) per optimizer step: k = S / (B*D), which must be whole."""
    if S < 1 or B < 1 or D < 1:
        raise ValueError(f"global, micro and world sizes must be positive, got {S=} {B=} {D=}")
    if S % (B * D):
        raise ValueError(
            f"global batch of {S} sequences is not a whole number of waves of "
            f"{B} sequences x {D} ranks = {B * D}"
        )
    return S // (B * D)


def sequence_ids(step: int, rank: int, micro: int, B: int, D: int, S: int) -> range:
    """Global sequence ids that `rank` runs at micro-step `micro` of optimizer step `step`.

    The ids are ``step*S + n`` for positions n in ``[(micro*D + rank)*B, (micro*D + rank + 1)*B)``.
    """
    k = micro_steps(S, B, D)
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if not 0 <= rank < D:
        raise ValueError(f"rank {rank} is outside a world of {D}")
    if not 0 <= micro < k:
        raise ValueError(f"micro-step {micro} is outside the {k} of each step")
    first = step * S + (micro * D + rank) * B
    return range(first, first + B)
