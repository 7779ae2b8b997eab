"""The document order: a seeded pseudo-random permutation per epoch, computed per index."""

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a bijective, well-mixing map of 64-bit integers."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


class Permutation:
    """A pseudo-random permutation of range(n) seeded by (seed, epoch), evaluated per index in O(1)
    time and memory: a balanced 6-round Feistel network on the smallest even number of bits that
    covers n (a permutation of range(4**k)), restricted to range(n) by cycle walking (applying it
    again while the value is >= n; fewer than 4 applications on average). Plain integer arithmetic:
    the same on every machine, Python and torch version."""

    ROUNDS = 6

    def __init__(self, n: int, seed: int, epoch: int):
        if n < 1:
            raise ValueError(f"a permutation of {n} elements")
        bits = max(2, (n - 1).bit_length())
        bits += bits & 1
        self.n, self.half, self.mask = n, bits // 2, (1 << (bits // 2)) - 1
        base = _mix64((_mix64((seed + _GOLDEN) & _M64) + epoch * _GOLDEN) & _M64)
        self.keys = [_mix64((base + (r + 1) * _GOLDEN) & _M64) for r in range(self.ROUNDS)]

    def _encrypt(self, x: int) -> int:
        left, right = x >> self.half, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix64(right ^ key) & self.mask)
        return (left << self.half) | right

    def __getitem__(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(i)
        x = self._encrypt(i)
        while x >= self.n:
            x = self._encrypt(x)
        return x


def derived_seed(seed: int, epoch: int) -> int:
    """A seed for permutations nested inside epoch `epoch` of `seed` (a streamed source's blocks)."""
    return _mix64((_mix64((seed + _GOLDEN) & _M64) ^ (epoch * _GOLDEN)) & _M64)
