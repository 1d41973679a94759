"""Small helpers that keep the library's required dependencies to torch and numpy.

``progress_bar`` is tqdm's bar when tqdm is installed, else a plain line on stderr at most once a
second; ``trigamma`` is ``psi'(x)`` in float64 (no scipy).
"""

from __future__ import annotations

import sys
import time


def trigamma(x: float) -> float:
    """``psi'(x) = sum_{i>=0} (x + i)^{-2}`` for ``x > 0``, to float64 rounding: the recurrence
    ``psi'(x) = psi'(x + 1) + x^-2`` up to ``x >= 20``, then the asymptotic series
    ``1/x + 1/(2x^2) + sum_j B_2j / x^(2j+1)``."""
    x = float(x)
    if not x > 0:
        raise ValueError(f"trigamma needs x > 0, got {x!r}")
    head = 0.0
    while x < 20.0:
        head += 1.0 / (x * x)
        x += 1.0
    inv2 = 1.0 / (x * x)
    series = inv2 * (1 / 6 - inv2 * (1 / 30 - inv2 * (1 / 42 - inv2 * (1 / 30 - inv2 * 5 / 66))))
    return head + 1.0 / x + 0.5 * inv2 + series / x


class _PlainBar:
    """What the recursion uses of tqdm's bar: ``update``, ``set_postfix``, ``close`` and iteration."""

    def __init__(self, iterable=None, total=None, initial=0, disable=False, desc="", mininterval=1.0, **_):
        self.iterable, self.total, self.n, self.disable, self.desc = iterable, total, initial, disable, desc
        self.mininterval, self.last, self.postfix = mininterval, time.monotonic(), ""
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            self.total = len(iterable)

    def __iter__(self):
        for item in self.iterable:
            yield item
            self.update(1)

    def update(self, n: int = 1) -> None:
        self.n += n
        if not self.disable and time.monotonic() - self.last >= self.mininterval:
            self.last = time.monotonic()
            print(f"{self.desc}: {self.n}/{self.total} {self.postfix}", file=sys.stderr, flush=True)

    def set_postfix(self, refresh: bool = True, **values) -> None:
        self.postfix = " ".join(f"{k}={v}" for k, v in values.items())

    def close(self) -> None:
        if not self.disable:
            print(f"{self.desc}: {self.n}/{self.total} {self.postfix}", file=sys.stderr, flush=True)


def progress_bar(iterable=None, **kwargs):
    """tqdm's ``tqdm.auto.tqdm`` when installed, else :class:`_PlainBar` with the same arguments."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _PlainBar(iterable, **kwargs)
    return tqdm(iterable, **kwargs)
