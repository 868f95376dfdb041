"""The paper's resource-allocation formulas (Section "Principled allocation of resources").

Notation (all times in seconds, all sizes in bytes):

* ``D``  machines (pipeline stages) in total; ``L`` transformer layers.
* ``M``  memory of one machine; ``W0`` weights of one layer.
* ``C0`` prompt KV of one layer for one microbatch; ``K0`` generated-token KV of one layer for
  one microbatch (sized for the longest generation, since caches are preallocated).
* ``Y``  prompt time of one microbatch on one stage when the model is split over ``D`` stages;
  ``t`` one token step of one microbatch on one stage at that split.
* ``N``  token steps per microbatch (generated tokens after the first, which the prompt yields).
* ``m``  slowdown of prompt processing caused by streaming its KV cache out (``m >= 1``).

Inverse throughputs ``I`` are seconds per microbatch in steady state. Every function here is
pure and raises ``ValueError`` on arguments outside its domain.
"""

from __future__ import annotations

import math


def _require_positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name} must be positive, got {value}")


def min_prompt_depth(L: int, C0: float, W0: float, M: float) -> int | None:
    """Eq. (1): ``D_p >= ceil(L (C0 + W0) / M)``, the fewest prompt stages that hold the model.

    This is the paper's continuous bound; a real split puts ``ceil(L / D_p)`` whole layers on
    its fullest stage, which the planner re-checks (``costmodel.StageMemory``). Returns
    ``None`` when not even one layer and its prompt KV fit on a machine.
    """
    _require_positive(L=L, M=M)
    per_layer = C0 + W0
    if per_layer <= 0:
        raise ValueError("C0 + W0 must be positive")
    if per_layer > M:
        return None
    return math.ceil(L * per_layer / M)


def min_token_depth(L: int, C0: float, K0: float, W0: float, M: float) -> float | None:
    """Eq. (2): the continuous lower bound ``D_t >= L W0 / (M - L (C0 + K0))``.

    With ``D_t`` microbatches in flight, each stage holds the KV of all of them for its own
    layers, i.e. ``L (C0 + K0)`` per stage whatever ``D_t`` is. When that alone fills (or
    exceeds) ``M`` no depth fits and the result is ``None``.
    """
    _require_positive(L=L, M=M)
    free = M - L * (C0 + K0)
    if free <= 0:
        return None
    return L * W0 / free


def baseline_inverse_throughput(D: int, Y: float, t: float, N: float) -> float:
    """Eq. (3): ``I_c = (D-1)(Y-t)/D + Y + N t`` for one pipeline of ``D`` stages doing both phases.

    Per wave of ``D`` microbatches, stage 1 spends ``D Y`` on prompts, waits ``(D-1)(Y-t)``
    for the prompts to drain before the first token round, and spends ``N D t`` on tokens.
    """
    _require_positive(D=D, Y=Y, t=t)
    if N < 0:
        raise ValueError(f"N must be >= 0, got {N}")
    return (D - 1) * (Y - t) / D + Y + N * t


def token_inverse_throughput(D: int, D_t: float, t: float, N: float) -> float:
    """``I_t = N D t / D_t``: a token pipeline of ``D_t`` stages, each ``D / D_t`` times slower."""
    _require_positive(D=D, D_t=D_t, t=t)
    if N < 0:
        raise ValueError(f"N must be >= 0, got {N}")
    return N * D * t / D_t


def prompt_inverse_throughput(D: int, D_p: float, Y: float, m: float) -> float:
    """``I_p = m D Y / D_p``: a prompt pipeline of ``D_p`` stages slowed by streaming (``m``)."""
    _require_positive(D=D, D_p=D_p, Y=Y, m=m)
    return m * D * Y / D_p


def disaggregated_inverse_throughput(D: int, D_p: float, D_t: float, Y: float, t: float, N: float, m: float) -> float:
    """``I_dis = max(I_t, I_p)``: the slower of the two pipelines sets the pace."""
    return max(token_inverse_throughput(D, D_t, t, N), prompt_inverse_throughput(D, D_p, Y, m))


def optimal_token_depth(D: int, Y: float, t: float, N: float, m: float) -> float:
    """Eq. (5): the continuous ``D_t = D N t / (m Y + N t)`` that makes ``I_t = I_p``."""
    _require_positive(D=D, Y=Y, t=t, m=m)
    if N < 0:
        raise ValueError(f"N must be >= 0, got {N}")
    return D * N * t / (m * Y + N * t)


def optimal_prompt_depth(D: int, Y: float, t: float, N: float, m: float) -> float:
    """Eq. (6): ``D_p = D - D_t = D m Y / (m Y + N t)``."""
    return D - optimal_token_depth(D, Y, t, N, m)


def benefit_threshold(D: int, m: float) -> float | None:
    """Eq. (4): the ``Y/t`` above which disaggregation beats the baseline, or ``None`` if none does.

    ``I_dis < I_c`` at the continuous optimum (where ``I_dis = m Y + N t``) simplifies to
    ``Y (D (2 - m) - 1) > (D - 1) t``; ``N`` cancels. The paper divides by ``D (2 - m) - 1``,
    valid only when it is positive, i.e. ``m < 2 - 1/D``. Otherwise the left side is ``<= 0``
    while the right is ``>= 0``, so no ``Y/t`` helps: this is the paper's "no benefit when
    ``m >= 2``", tightened to ``m >= 2 - 1/D``. (With ``D == 1`` and ``m < 1`` the threshold is 0.)
    """
    _require_positive(D=D, m=m)
    denominator = D * (2 - m) - 1
    if denominator <= 0:
        return None
    return (D - 1) / denominator


def disaggregation_beneficial(D: int, Y: float, t: float, m: float) -> bool:
    """Whether the continuous optimum of Eq. (5)-(6) has a lower inverse throughput than Eq. (3).

    Evaluated in the multiplied-out form ``Y (D (2 - m) - 1) > (D - 1) t`` so the sign of the
    denominator never needs a case split.
    """
    _require_positive(D=D, Y=Y, t=t, m=m)
    return Y * (D * (2 - m) - 1) > (D - 1) * t


def integer_split(
    D: int, Y: float, t: float, N: float, m: float, min_prompt: int = 1, min_token: int = 1
) -> tuple[int, int] | None:
    """The integer ``(D_p, D_t)`` with ``D_p + D_t = D`` minimising ``I_dis`` under memory minima.

    ``I_t`` falls and ``I_p`` rises with ``D_t``, so their max is unimodal in ``D_t`` with its
    minimum at the continuous optimum; the best integer is therefore the floor or the ceiling
    of that optimum, each clamped into the feasible range ``[min_token, D - min_prompt]``.
    Returns ``None`` when that range is empty (the memory minima need more than ``D`` machines).
    """
    _require_positive(D=D, min_prompt=min_prompt, min_token=min_token)
    low, high = min_token, D - min_prompt
    if low > high:
        return None
    continuous = optimal_token_depth(D, Y, t, N, m)
    candidates = {min(max(c, low), high) for c in (math.floor(continuous), math.ceil(continuous))}
    best = min(
        candidates,
        key=lambda d_t: (disaggregated_inverse_throughput(D, D - d_t, d_t, Y, t, N, m), d_t),
    )
    return D - best, best


# -- The serving runtime's cohort policy (not in the paper) ----------------------------------------
# Stage times here are those of the pipeline's slowest stage at its own depth: ``t_R`` is one
# token pass of a cohort of ``R`` rows on it, ``Y_b`` one prompt of a microbatch of ``b`` on it.


def cohort_rows(max_running: int, depth: int, b: int) -> int:
    """Rows a full cohort holds: whole microbatches of ``b`` up to ``ceil(max_running / depth)`` (at least one)."""
    _require_positive(max_running=max_running, depth=depth, b=b)
    cap = -(-max_running // depth)
    return b * max(1, cap // b)


def cohort_token_inverse_throughput(b: int, R: int, t_R: float, N: float) -> float:
    """``I_t = b N t_R / R``: seconds per microbatch of ``b`` requests through a cohort token pipeline.

    ``D_t`` cohorts of ``R`` rows keep every stage busy, so the slowest stage advances ``R`` rows by
    one token every ``t_R``; a request holds its row for ``N`` token steps.
    """
    _require_positive(b=b, R=R, t_R=t_R)
    if N < 0:
        raise ValueError(f"N must be >= 0, got {N}")
    return b * N * t_R / R


def cohort_colocated_inverse_throughput(b: int, R: int, Y_b: float, t_R: float, N: float) -> float:
    """``I_c = Y_b + b N t_R / R``: one pipeline whose cohorts interleave prefills with token passes.

    Per microbatch the slowest stage spends one prefill and its share of the token passes; cohorts
    keep every stage busy, so nothing waits for a drain (the paper's Eq. 3 term).
    """
    _require_positive(Y_b=Y_b)
    return Y_b + cohort_token_inverse_throughput(b, R, t_R, N)
