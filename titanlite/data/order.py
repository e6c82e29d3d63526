"""The global window order of prepared data: which source and which window each global index reads.

Both steps are arithmetic on the index alone, so any rank finds any position in constant time
and no rank holds anything that grows with the dataset:

1. Mixture: global index k goes to one source. Sources are split off one at a time: the first
   takes every index where ``floor((j + 1) * q)`` steps up (j counts the indices still open,
   q is the source's share of them), the rest is split the same way among the others. Every
   prefix of n indices then gives source i ``n * weight_i`` indices to within a window or two.
   Weights are exact fractions, so every machine computes the same split.
2. Shuffle: a source's j-th window is window ``j mod W`` of its epoch ``j // W`` (W whole
   windows per epoch), put through a seeded permutation of ``range(W)`` that is new every
   epoch: a 4-round Feistel network over the next even power of two, walked until it lands
   below W. Every window of an epoch is read exactly once, in an order that only the seed,
   the source and the epoch decide.
"""

from __future__ import annotations

import hashlib
from fractions import Fraction

_MASK64 = (1 << 64) - 1
_ROUNDS = 4


def _mix64(value: int) -> int:
    """splitmix64's finalizer: every input bit moves about half the output bits."""
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


class EpochPermutation:
    """A seeded bijection of ``range(size)``, evaluated one index at a time."""

    def __init__(self, size: int, seed: int, source: int, epoch: int):
        if size < 1:
            raise ValueError(f"permutation size: expected >= 1, got {size}")
        self.size = size
        bits = max(2, (size - 1).bit_length())
        self._half_bits = (bits + 1) // 2  # two equal halves: the domain is 4**half_bits < 4 * size
        self._half_mask = (1 << self._half_bits) - 1
        digest = hashlib.blake2b(
            f"titanlite-shuffle/{seed}/{source}/{epoch}".encode(), digest_size=8 * _ROUNDS
        ).digest()
        self._round_keys = [int.from_bytes(digest[8 * r : 8 * r + 8], "little") for r in range(_ROUNDS)]

    def __call__(self, index: int) -> int:
        if not 0 <= index < self.size:
            raise IndexError(f"permutation index {index} outside [0, {self.size})")
        # Cycle-walking: the network permutes a larger power-of-two domain, and following it
        # from an index below size until it lands below size again stays a bijection of range(size).
        value = self._encrypt(index)
        while value >= self.size:
            value = self._encrypt(value)
        return value

    def _encrypt(self, value: int) -> int:
        left, right = value >> self._half_bits, value & self._half_mask
        for key in self._round_keys:
            left, right = right, left ^ (_mix64((right + key) & _MASK64) & self._half_mask)
        return (left << self._half_bits) | right


class Mixture:
    """Assigns global window indices to sources in proportion to exact weights."""

    def __init__(self, weights: list[Fraction]):
        if not weights or any(weight <= 0 for weight in weights):
            raise ValueError(f"mixture weights: expected positive numbers, got {[str(w) for w in weights]}")
        total = sum(weights)
        self.weights = [weight / total for weight in weights]
        # The share of what is left that each source (but the last) takes, as numerator/denominator.
        self._splits = []
        remaining = Fraction(1)
        for weight in self.weights[:-1]:
            share = weight / remaining
            self._splits.append((share.numerator, share.denominator))
            remaining -= weight

    def locate(self, index: int) -> tuple[int, int]:
        """(source, how many earlier indices went to that source) for global index ``index``."""
        for source, (numerator, denominator) in enumerate(self._splits):
            taken_before = index * numerator // denominator
            taken_through = (index + 1) * numerator // denominator
            if taken_through > taken_before:
                return source, taken_before
            index -= taken_through  # position among the indices the later sources share
        return len(self._splits), index

    def counts(self, prefix: int) -> list[int]:
        """How many of the first ``prefix`` indices each source gets."""
        counts = []
        for numerator, denominator in self._splits:
            taken = prefix * numerator // denominator
            counts.append(taken)
            prefix -= taken
        return counts + [prefix]
