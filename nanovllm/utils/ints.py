"""Integer helpers shared by the kernels' launchers, the cache and the policies."""
from nanovllm.utils.checks import is_integer


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


def is_pow2(n: int) -> bool:
    """True for an integer (any ``numbers.Integral`` but bool) power of two; False for anything
    else, floats included."""
    return is_integer(n) and n >= 1 and n & (n - 1) == 0
