"""The caching allocator's block and the ledger of a layer's saved tensors."""

from __future__ import annotations

from enum import StrEnum
from functools import lru_cache

from service.core.libs.torch_allocator import MIN_BLOCK as ALLOC_BLOCK
from service.core.libs.torch_kernels import EFFICIENT_LSE_PAD


def _blk(nbytes: int) -> int:
    """Bytes the allocator hands out for a request of `nbytes`."""
    if nbytes <= 0:
        return 0
    return -(-nbytes // ALLOC_BLOCK) * ALLOC_BLOCK


class _Kind(StrEnum):
    """How a saved tensor's size scales with the micro-batch b and sequence length s."""

    TOKENS = "b*s"
    TOKENS_PAD32 = "b*ceil32(s)"  # memory-efficient attention pads its logsumexp
    SQUARE = "b*s*s"  # eager attention's scores and probabilities
    # keys and values behind prefix tuning's virtual tokens, k of them: b*(s+k) and b*s*(s+k)
    KEYS = "b*(s+k)"
    KEYS_SQUARE = "b*s*(s+k)"
    CONSTANT = "1"  # a weight-sized tensor: the same for every batch and sequence length


class _Ledger:
    """A layer's saved tensors by identity (a storage saved by several ops counts once), each
    as bytes per unit of its `_Kind`; `_recipe_bytes(recipe, b, s)` rounds each tensor to the
    block."""

    __slots__ = ("items",)

    def __init__(self) -> None:
        self.items: dict[str, tuple[int, _Kind]] = {}

    def add(self, key: str, per_token: int, kind: _Kind = _Kind.TOKENS) -> None:
        if key not in self.items:
            self.items[key] = (per_token, kind)

    def recipe(self) -> tuple[tuple[int, _Kind, int], ...]:
        """(bytes per unit, kind, how many tensors of that size)."""
        counts: dict[tuple[int, _Kind], int] = {}
        for item in self.items.values():
            counts[item] = counts.get(item, 0) + 1
        return tuple((coef, kind, n) for (coef, kind), n in counts.items())


def _recipe_bytes(
    recipe: tuple[tuple[int, _Kind, int], ...], b: int, s: int, prefix: int = 0
) -> int:
    """The bytes of a layer's saved tensors (`_Ledger.recipe`) at b x s, remembered for plain
    sizes; shapes being recorded (`symbolic.Shape`) are summed each time."""
    if type(b) is int and type(s) is int:
        return _remembered_recipe_bytes(recipe, b, s, prefix)
    return _sum_recipe(recipe, b, s, prefix)


@lru_cache(maxsize=4096)
def _remembered_recipe_bytes(
    recipe: tuple[tuple[int, _Kind, int], ...], b: int, s: int, prefix: int
) -> int:
    return _sum_recipe(recipe, b, s, prefix)


def _sum_recipe(recipe: tuple[tuple[int, _Kind, int], ...], b: int, s: int, prefix: int) -> int:
    units = {
        _Kind.KEYS: b * (s + prefix),
        _Kind.KEYS_SQUARE: b * s * (s + prefix),
        _Kind.TOKENS: b * s,
        _Kind.TOKENS_PAD32: b * (-(-s // EFFICIENT_LSE_PAD) * EFFICIENT_LSE_PAD),
        _Kind.SQUARE: b * s * s,
        _Kind.CONSTANT: 1,
    }
    return sum(n * _blk(coef * units[kind]) for coef, kind, n in recipe)
