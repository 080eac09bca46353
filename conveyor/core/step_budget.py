"""A step-time target for the token budget: Sarathi-Serve's stall-free batching, sized by time.

A step that carries a long prompt chunk next to decoding requests takes as long as that chunk,
and every decoding request waits that long for its next token. With a target (max_step_ms),
the scheduler first gives every decoding request its token, then lets prompts add only what
fits in the target (a step without decodes keeps the whole token budget: nobody waits on it):

    a prompt's chunk = min(token budget left, largest n with t(step so far + n tokens) <= limit)
    limit            = max(target, (1 + DECODE_OVERRUN_SHARE) * t(the step's decodes alone))

The first prompt chunk of a step always gets at least MIN_PREFILL_CHUNK tokens, so a prompt
never starves; decodes are never cut (a step of decodes alone may exceed the target, which no
chunking can help: then prompts may still add DECODE_OVERRUN_SHARE of the decodes' time, so
that a load or a model too large for the target keeps a usable time to first token).

t is a linear model of a step's seconds, learnt from the steps the engine ran (StepTimeModel):

    t = c0 + c1 * decode tokens + c2 * prefill tokens
           + c3 * decode attention pairs + c4 * prefill attention pairs

An attention pair is one (query, key) product: a decode row at context C reads C + 1 keys, a
chunk of n tokens after C computed ones n * C + n (n + 1) / 2. Decode rows read the paged KV
cache one row at a time and cost several times more per pair than a chunk's, hence two terms.
Timing changes only where prompts are cut, never which tokens a request gets.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from conveyor.outputs import SchedulerOutput

# The smallest prompt chunk the first prompt of a step is given, whatever the target.
MIN_PREFILL_CHUNK = 32
# When a step's decodes alone exceed the target, its prompts may still add this share of their
# time (1.0: such a step takes at most twice its decodes'). In a simulation of the scheduler at
# 64 streams with this machine's measured step costs, 0.5 nearly doubled the mean time to first
# token against the token budget alone; 1.0 kept it.
DECODE_OVERRUN_SHARE = 1.0
# Steps remembered, each kind in a window of its own: steps with a prompt chunk and steps of
# decodes only. A long stretch of decoding does not push out what prompts cost, and the windows
# follow the machine's current load (a neighbour on the CPU, a bigger context) within seconds.
WINDOW = 64
# The prior, in seconds per unit of each feature: about 1.5x what SmolLM2-135M (Q4_1) costs on
# 2 vCPUs of a Xeon (`python -m benchmarks step --num-threads 0`: 5.9 ms for one decode row,
# 40.5 for 32 at context 256, of which 14.5 attention; 85 for a 256-token chunk, 214 for 512),
# so that a fresh engine cuts prompts too small rather than too large until its own steps are
# known. Other models and devices correct it within a few steps (a slower one after a few steps
# over the target).
PRIOR = (6e-3, 1.0e-3, 0.5e-3, 2.5e-3, 0.35e-3)  # const, decode / prefill token, kilo-pair
# The prior counts as this many steps of TYPICAL_STEP's shape: each coefficient is pulled
# towards its prior as strongly as that many such steps, timed as the prior says, would pull it.
PRIOR_WEIGHT = 2.0
# 32 decode rows at context 512 and a 256-token chunk at context 256 (features as StepShape's).
TYPICAL_STEP = (1.0, 32.0, 256.0, 32 * 512 / 1000, (256 * 256 + 256 * 257 / 2) / 1000)
# An engine's first steps pay one-time costs (memory first touched, lazy initialization), up to
# seconds on a CPU: they are not observed.
NUM_WARMUP_STEPS = 2
# Huber reweighting of relative residuals: steps slowed by a neighbour on the CPU count little.
HUBER_K = 1.5
HUBER_PASSES = 2
MIN_RELATIVE_SCALE = 0.02  # residual scale below which no step is down-weighted
# New steps between refits (a fit costs a few hundred microseconds; costs drift slowly).
REFIT_EVERY = 4


class StepShape(NamedTuple):
    """What a step computes, in the cost model's terms."""

    decode_tokens: int = 0  # one per decoding request, plus its drafts
    prefill_tokens: int = 0  # prompt (or recomputed) tokens
    decode_pairs: int = 0  # (query, key) products of the decode rows
    prefill_pairs: int = 0  # (query, key) products of the prompt chunks

    def plus(self, context: int, num_tokens: int, decode: bool) -> StepShape:
        """This shape with one more request: `num_tokens` after `context` computed ones."""
        pairs = num_tokens * context + num_tokens * (num_tokens + 1) // 2
        if decode:
            return self._replace(
                decode_tokens=self.decode_tokens + num_tokens,
                decode_pairs=self.decode_pairs + pairs,
            )
        return self._replace(
            prefill_tokens=self.prefill_tokens + num_tokens,
            prefill_pairs=self.prefill_pairs + pairs,
        )

    @property
    def decodes(self) -> StepShape:
        return StepShape(self.decode_tokens, 0, self.decode_pairs, 0)

    @property
    def features(self) -> tuple[float, float, float, float, float]:
        """Pairs in thousands, so that no coefficient is tiny next to the others."""
        return (
            1.0,
            float(self.decode_tokens),
            float(self.prefill_tokens),
            self.decode_pairs / 1000,
            self.prefill_pairs / 1000,
        )


def step_shape(sched: SchedulerOutput) -> StepShape:
    """The shape of a scheduled step. A row of one token of its own (plus any drafts) is a
    decode row: a prompt's last token alone costs what a decode does."""
    shape = StepShape()
    for row in sched.scheduled:
        shape = shape.plus(row.num_computed_tokens, row.num_tokens, len(row.token_ids) == 1)
    return shape


class StepTimeModel:
    """Seconds of a step from its shape: weighted least squares over the recent steps, on
    relative error (a 5 ms step's noise counts as much as a 200 ms one's), pulled towards the
    prior by PRIOR_WEIGHT steps' worth, with Huber weights against outliers and every
    coefficient kept >= 0 (so that more work never predicts less time). Refitted lazily: when
    a prediction follows REFIT_EVERY new steps (or the first ones). window=0 never learns: the
    prior is the model (tests)."""

    def __init__(self, prior: tuple[float, ...] = PRIOR, window: int = WINDOW) -> None:
        if len(prior) != len(PRIOR) or min(prior) <= 0:
            raise ValueError(f"a prior needs {len(PRIOR)} coefficients > 0, got {prior!r}")
        self.prior = np.array(prior, dtype=np.float64)
        self._coefficients = tuple(float(c) for c in prior)
        self._steps = {kind: deque(maxlen=window) for kind in ("prefill", "decode")}
        self._num_new = 0  # steps observed since the last fit
        self._fitted = False
        self._num_warmup = NUM_WARMUP_STEPS

    @property
    def num_observed(self) -> int:
        return sum(len(steps) for steps in self._steps.values())

    def observe(self, shape: StepShape, seconds: float) -> None:
        if seconds <= 0 or shape.decode_tokens + shape.prefill_tokens == 0:
            return
        if self._num_warmup > 0:
            self._num_warmup -= 1
            return
        kind = "prefill" if shape.prefill_tokens else "decode"
        self._steps[kind].append((shape.features, seconds))
        self._num_new += 1

    @property
    def coefficients(self) -> tuple[float, ...]:
        """Seconds per unit of each of StepShape.features, as of the steps seen so far."""
        if self._num_new >= REFIT_EVERY or (self._num_new and not self._fitted):
            self.fit()
        return self._coefficients

    def predict(self, shape: StepShape) -> float:
        return sum(c * x for c, x in zip(self.coefficients, shape.features, strict=True))

    def fit(self) -> None:
        self._num_new = 0
        rows = [row for steps in self._steps.values() for row in steps]
        if not rows:
            return
        self._fitted = True
        x = np.array([features for features, _ in rows])  # (steps, features)
        y = np.array([seconds for _, seconds in rows])
        beta = self._solve(x, y, 1 / y**2)
        for _ in range(HUBER_PASSES):
            relative = np.abs(y - x @ beta) / y
            middle = len(relative) // 2  # the median (the upper one), without np.median's cost
            scale = max(1.4826 * float(np.partition(relative, middle)[middle]), MIN_RELATIVE_SCALE)
            huber = np.minimum(1.0, HUBER_K * scale / np.maximum(relative, 1e-12))
            beta = self._solve(x, y, huber / y**2)
        self._coefficients = tuple(float(c) for c in beta)

    def _solve(self, x: np.ndarray, y: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """Ridge towards the prior (PRIOR_WEIGHT typical steps' worth on relative error), with
        negative coefficients pinned to 0 in turn."""
        typical = np.array(TYPICAL_STEP)
        ridge = PRIOR_WEIGHT * (typical / (typical @ self.prior)) ** 2
        a = (x * weights[:, None]).T @ x + np.diag(ridge)
        b = (x * weights[:, None]).T @ y + ridge * self.prior
        beta = np.linalg.solve(a, b)
        free = np.ones(len(b), dtype=bool)
        while (beta < 0).any():  # each pass pins at least one more coefficient at 0
            free &= beta > 0
            if not free.any():
                return self.prior.copy()  # no positive fit at all: nothing learnt
            beta = np.zeros(len(b))
            beta[free] = np.linalg.solve(a[np.ix_(free, free)], b[free])
        return beta

    def max_chunk(self, step: StepShape, context: int, limit: float, max_tokens: int) -> int:
        """The most prompt tokens (<= max_tokens) after `context` computed ones that keep the
        step within `limit` seconds; 0 when none does. Predictions grow with the chunk (the
        coefficients are >= 0), so a binary search finds it."""
        low, high = 0, max_tokens
        while low < high:
            mid = (low + high + 1) // 2
            if self.predict(step.plus(context, mid, decode=False)) <= limit:
                low = mid
            else:
                high = mid - 1
        return low


class StepBudget:
    """The step-time target and its cost model: how many prompt tokens a step may add."""

    def __init__(self, max_step_ms: float, model: StepTimeModel | None = None) -> None:
        self.target = max_step_ms / 1000
        self.model = model if model is not None else StepTimeModel()

    def prefill_cap(self, step: StepShape, context: int, max_tokens: int) -> int:
        """Tokens (<= max_tokens) that a prompt chunk after `context` computed tokens may add
        to `step` (what is already scheduled in it)."""
        if step.decode_tokens == 0:
            return max_tokens  # no decoding request waits on this step
        decodes = self.model.predict(step.decodes)
        limit = max(self.target, (1 + DECODE_OVERRUN_SHARE) * decodes)
        num_tokens = self.model.max_chunk(step, context, limit, max_tokens)
        if step.prefill_tokens == 0:  # the step's first prompt chunk: never starved
            num_tokens = max(num_tokens, min(MIN_PREFILL_CHUNK, max_tokens))
        return num_tokens

    def observe(self, shape: StepShape, seconds: float) -> None:
        self.model.observe(shape, seconds)
