"""MPMoE's adaptive pipeline-granularity search (paper 004, Algorithm 1; PAPERS.md §4.5).

The best pipeline degree n for a token count B is found by profiling, cheaply, from two
hypotheses: (H1) the best n grows with B, so the B axis splits into disjoint ranges with one best
n each; (H2) the layer time is parabola-like in n, so a scan can stop at the turning point.

State: ``G`` maps n -> (B_floor, B_ceil), the range of token counts whose best degree is n (sorted
by n, the ranges increasing with n), initially ``{n_min: (0, 1), n_max: (inf, inf)}`` (the
listing's reading, PAPERS.md §4.5 ambiguity 1), and ``C`` caches answered B. For a new B:

1. find the range i containing B, or the closest one;
2. B inside it: n_i. B above it: scan n from n_i up to the next key; below: from the previous
   key up to n_i (every integer, ambiguity 2), profiling each, and stop when the time rises (H2);
3. record B in G: a new key n = (B, B) if n is strictly between the bounds, else extend n's range.

:class:`GranularitySearch` is the algorithm; :meth:`GranularitySearch.best` runs it against a
profiling function (a synthetic oracle in tests, the simulator, or timed steps), and
:meth:`GranularitySearch.steps` is the same search as a generator for online use, where each
profile is one training step (the expert-parallel layer's ``pipeline_degree="search"``).
"""

from __future__ import annotations

import math
from typing import Callable, Generator, Optional

__all__ = ["GranularitySearch"]


class GranularitySearch:
    """MPMoE Algorithm 1 over degrees ``[n_min, n_max]`` (the paper's [2, 8] by default).

    Attributes:
        G: ``{n: (B_floor, B_ceil)}``, kept sorted by n.
        C: ``{B: n}`` answered token counts.
        profiled: how many (B, n) profiles the search has asked for.
    """

    def __init__(self, n_min: int = 2, n_max: int = 8) -> None:
        if not (isinstance(n_min, int) and isinstance(n_max, int) and 1 <= n_min < n_max):
            raise ValueError(f"degrees [{n_min}, {n_max}]: need integers 1 <= n_min < n_max")
        self.n_min, self.n_max = n_min, n_max
        self.G: dict[int, tuple[float, float]] = {n_min: (0.0, 1.0), n_max: (math.inf, math.inf)}
        self.C: dict[float, int] = {}
        self.profiled = 0

    # -- the ranges ----------------------------------------------------------------------------

    def _keys(self) -> list[int]:
        return sorted(self.G)

    def _closest(self, B: float) -> int:
        """The key whose range contains B, else the one whose range is nearest (ties: lower n)."""
        best, dist = None, math.inf
        for n in self._keys():
            lo, hi = self.G[n]
            if lo <= B <= hi:
                return n
            d = lo - B if B < lo else B - hi
            if d < dist:
                best, dist = n, d
        return best

    # -- the search ----------------------------------------------------------------------------

    def steps(self, B: float) -> Generator[int, float, int]:
        """The search for token count ``B`` as a generator: it yields each degree to profile,
        expects the measured time sent back, and returns the chosen degree
        (``StopIteration.value``). Answers from the cache or a known range yield nothing."""
        if B in self.C:
            return self.C[B]
        n_i = self._closest(B)
        lo, hi = self.G[n_i]
        keys = self._keys()
        j = keys.index(n_i)
        n_floor = n_ceil = n = n_i
        if B > hi and j + 1 < len(keys):
            n_floor, n_ceil = n_i, keys[j + 1]
            n = yield from self._scan(B, n_floor, n_ceil)
        elif B < lo and j > 0:
            n_floor, n_ceil = keys[j - 1], n_i
            n = yield from self._scan(B, n_floor, n_ceil)
        if n != n_floor and n != n_ceil:
            self.G[n] = (B, B)
        else:
            lo, hi = self.G[n]
            self.G[n] = (min(B, lo), max(B, hi))
        self.G = dict(sorted(self.G.items()))
        self.C[B] = n
        return n

    def _scan(self, B: float, n_floor: int, n_ceil: int) -> Generator[int, float, int]:
        """Profile n_floor, n_floor + 1, ... n_ceil; stop when the time rises (parabola-like)."""
        best_n, best_t = n_floor, math.inf
        prev = math.inf
        for n in range(n_floor, n_ceil + 1):
            self.profiled += 1
            t = yield n
            if t is None or not math.isfinite(t):
                raise ValueError(f"GranularitySearch: profiling n={n} for B={B} returned {t!r}; send a time in seconds")
            if t < best_t:
                best_n, best_t = n, t
            if t > prev:
                break
            prev = t
        return best_n

    def best(self, B: float, profile: Callable[[float, int], float]) -> int:
        """Run the search for ``B`` to the end, calling ``profile(B, n) -> seconds``."""
        gen = self.steps(B)
        try:
            n = next(gen)
            while True:
                n = gen.send(profile(B, n))
        except StopIteration as stop:
            return stop.value

    def answer(self, B: float) -> Optional[int]:
        """The cached answer for ``B``, or None."""
        return self.C.get(B)
