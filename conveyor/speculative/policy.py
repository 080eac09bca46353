"""How many drafts to verify this step: only those expected to raise tokens per second.

Verifying a draft widens the step by one token. While a step is bound by reading the weights
(small batches on a CPU, almost any batch on a GPU) that costs little, and every draft likely
to be accepted is worth it; once the step is bound by arithmetic (large batches on a CPU) a
token of width costs as much as a token of output, and drafts that may be rejected lower the
throughput. So the scheduler adds drafts one at a time, most likely first, while

    (E + p) / t(T + 1) > E / t(T)    i.e.    p * t(T) > E * (t(T + 1) - t(T)),

where T is the step's width so far, E its expected output tokens, t the step time and p the
chance that this draft is accepted. For the j-th draft of request r, p = rate_r * c_2 * ...
* c_j: rate_r from that request's own acceptance so far (a decayed count, started from the
engine-wide rate), c_i the engine-wide chance that draft i is accepted once draft i - 1 was.
Acceptance comes in runs (a copied passage accepts draft after draft, an edit rejects the
first), so c_i is usually well above rate_r, and rate_r ** j would cut runs short.

t(T) is learned from the engine's own steps (StepCostModel): no calibration, and it follows
the machine, the model, the device and the load. Until two widths have been seen, drafts are
all taken (which is also how the wider widths get seen).
"""

from __future__ import annotations

import heapq
import statistics
from collections import deque

# Decay of the acceptance counts per verification: about the last 5 verifications count; the
# engine-wide chances by position keep about the last 50.
ACCEPTANCE_DECAY = 0.8
POSITION_DECAY = 0.98
# Decay per step of the counts of a request that proposed drafts but verified none: a request
# (and the engine) written off as hopeless drifts back to the prior and is tried again, about
# every 6 steps at batch 1 while it keeps failing, one draft each time: ~2% of the steps.
IDLE_DECAY = 0.95
# Weight of the engine-wide rate in a request's estimate, in verifications.
PRIOR_WEIGHT = 2.0
# Steps remembered per bucket of widths, the fewest that make it count, and how many steps
# of the engine a bucket is kept without a new one.
COST_WINDOW = 15
COST_MIN_STEPS = 3
COST_MAX_AGE = 100


class StepCostModel:
    """Seconds of a step as a function of its width in tokens, from observed steps: per
    power-of-two bucket of widths, the mean width and the median time of its last steps (a
    step slowed by a neighbour on the CPU does not move it), and straight lines between
    those points (extended past the ends by the nearest slope).

    A bucket counts once it holds COST_MIN_STEPS steps, and while its last step is at most
    COST_MAX_AGE steps old: a width the policy stopped taking (because it looked too costly,
    maybe through noise) is forgotten and so measured again, rather than avoided for good."""

    def __init__(self) -> None:
        self._recent: dict[int, deque[tuple[int, float]]] = {}  # bucket -> (width, seconds)
        self._last_seen: dict[int, int] = {}  # bucket -> step count when last observed
        self._num_steps = 0
        self._points: list[tuple[float, float]] = []  # (mean width, median seconds), sorted

    def observe(self, num_tokens: int, seconds: float) -> None:
        self._num_steps += 1
        bucket = num_tokens.bit_length()
        recent = self._recent.setdefault(bucket, deque(maxlen=COST_WINDOW))
        recent.append((num_tokens, seconds))
        self._last_seen[bucket] = self._num_steps
        for old in [
            b for b, seen in self._last_seen.items() if self._num_steps - seen > COST_MAX_AGE
        ]:
            del self._recent[old], self._last_seen[old]
        self._points = sorted(
            (statistics.fmean(w for w, _ in steps), statistics.median(s for _, s in steps))
            for steps in self._recent.values()
            if len(steps) >= COST_MIN_STEPS
        )

    @property
    def known(self) -> bool:
        return len(self._points) >= 2

    def cost(self, num_tokens: float) -> float:
        points = self._points
        for i in range(len(points) - 1):
            (x0, y0), (x1, y1) = points[i], points[i + 1]
            if num_tokens <= x1 or i == len(points) - 2:
                # Noise can make a wider bucket look cheaper: never below flat.
                slope = max((y1 - y0) / (x1 - x0), 0.0) if x1 > x0 else 0.0
                return max(y0 + slope * (num_tokens - x0), 1e-6)
        return points[0][1]


class DraftPolicy:
    def __init__(self, adaptive: bool = True) -> None:
        self.adaptive = adaptive  # False: every draft, always
        self.cost = StepCostModel()
        # Engine-wide decayed counts of accepted drafts / drafts tried, over a prior of 1 / 2.
        self._accepted = 0.0
        self._tried = 0.0
        # By draft position i: verifications that reached draft i (all before it accepted),
        # and those that accepted it.
        self._reached: list[float] = []
        self._kept: list[float] = []

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        self.cost.observe(num_tokens, seconds)

    def observe_verification(self, counts: list[float], num_drafts: int, num_accepted: int) -> None:
        """Updates a request's [accepted, tried] counts (in place) and the engine's. Drafts
        after the first rejected one were never tried on their own merit."""
        tried = num_accepted + (num_accepted < num_drafts)
        counts[0] = counts[0] * ACCEPTANCE_DECAY + num_accepted
        counts[1] = counts[1] * ACCEPTANCE_DECAY + tried
        self._accepted = self._accepted * ACCEPTANCE_DECAY + num_accepted
        self._tried = self._tried * ACCEPTANCE_DECAY + tried
        if len(self._reached) < num_drafts:
            grow = num_drafts - len(self._reached)
            self._reached += [0.0] * grow
            self._kept += [0.0] * grow
        for i in range(len(self._reached)):
            self._reached[i] = self._reached[i] * POSITION_DECAY + (
                i < num_drafts and i <= num_accepted
            )
            self._kept[i] = self._kept[i] * POSITION_DECAY + (i < num_accepted)

    def _continuation(self, position: int) -> float:
        """Chance that draft `position` (0-based, >= 1) is accepted given the one before it
        was, engine-wide, over a prior of 3 / 4."""
        if position >= len(self._reached):
            return 0.75
        return (self._kept[position] + 1.5) / (self._reached[position] + 2.0)

    def rate(self, counts: list[float]) -> float:
        prior = (self._accepted + 1.0) / (self._tried + 2.0)
        return (counts[0] + PRIOR_WEIGHT * prior) / (counts[1] + PRIOR_WEIGHT)

    def choose(
        self,
        candidates: list[tuple[str, list[float], int]],  # request id, its counts, max drafts
        num_tokens: int,  # the step's width before drafts
        num_sampling: int,  # requests that sample a token this step
        budget: int,
    ) -> dict[str, int]:
        """Drafts per request id, most likely first, while each raises expected tokens/s."""
        chosen: dict[str, int] = {}
        if not self.adaptive or not self.cost.known:
            for request_id, _, max_drafts in candidates:
                take = min(max_drafts, budget)
                if take <= 0:
                    break
                chosen[request_id] = take
                budget -= take
            return chosen
        heap = []
        for request_id, counts, max_drafts in candidates:
            rate = self.rate(counts)
            heap.append((-rate, request_id, rate, 1, max_drafts))
        heapq.heapify(heap)
        width, expected = num_tokens, float(num_sampling)
        seconds = self.cost.cost(width)
        while heap and budget > 0:
            neg_p, request_id, rate, j, max_drafts = heapq.heappop(heap)
            p = -neg_p
            wider = self.cost.cost(width + 1)
            if p * seconds <= expected * (wider - seconds):
                break  # the most likely draft left does not pay; none after it does
            chosen[request_id] = j
            width, expected, seconds, budget = width + 1, expected + p, wider, budget - 1
            if j < max_drafts:
                p_next = p * self._continuation(j)
                heapq.heappush(heap, (-p_next, request_id, rate, j + 1, max_drafts))
        if len(chosen) < len(candidates):
            for request_id, counts, _ in candidates:
                if request_id not in chosen:
                    counts[0] *= IDLE_DECAY
                    counts[1] *= IDLE_DECAY
            if not chosen:
                self._accepted *= IDLE_DECAY
                self._tried *= IDLE_DECAY
        return chosen
