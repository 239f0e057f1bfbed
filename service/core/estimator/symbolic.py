"""A step's bytes as functions of the micro-batch size and sequence length.

Every byte count of the step is integer arithmetic on the job's shape: tensor sizes are
products of b, s and constants, rounded to the allocator's block (`ledger._blk`), summed, and
compared to pick a phase's largest moment. Run once with b and s as `Shape` values, the step
records that arithmetic: each value a polynomial in b, s and floor divisions of earlier
polynomials, each comparison a guard (the polynomial's sign as it came out). Compiled to one
Python function, the record gives the same integers at any other shape where every guard
comes out the same way; where one does not, the function returns None and the step is run
again (`pieces.py`).

Nothing shape-dependent can leave the record unseen: a `Shape` is neither hashable nor
convertible to an int or a float, so a cache lookup, a bit length or a true division on it
raises TypeError and the step is simply not compiled. Text formatted from a shape (a warning
naming the sequence length) marks the record, whose notes then hold only where it was made.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

# A monomial: (variable, power) pairs in variable order; variable 0 is b, 1 is s, and k >= 2
# the k-th floor division the record made (`Trace.atoms`).
Monomial = tuple[tuple[int, int], ...]
Terms = dict[Monomial, int]
BATCH, SEQ = 0, 1
_CONSTANT: Monomial = ()

# A guard: the terms of a difference and the comparison with zero that held.
_HOLDS: dict[str, Callable[[int, int], bool]] = {
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
    "==": operator.eq,
    "!=": operator.ne,
}
_NEGATED = {"<": ">=", "<=": ">", ">": "<=", ">=": "<", "==": "!=", "!=": "=="}


class Trace:
    """The record of one run at a concrete shape: the floor divisions made and the guards."""

    __slots__ = ("_atom_of", "atoms", "formatted", "guards", "values")

    def __init__(self, batch: int, seq: int) -> None:
        self.values: list[int] = [batch, seq]  # each variable's value in this run
        self.atoms: list[tuple[Terms, int]] = []  # variable 2 + i: atoms[i][0] // atoms[i][1]
        # each division's variable, by its terms and divisor: one variable per division made
        self._atom_of: dict[tuple[tuple[tuple[Monomial, int], ...], int], int] = {}
        self.guards: dict[tuple[tuple[tuple[Monomial, int], ...], str], None] = {}
        self.formatted = False  # whether text was made from a shape

    def shape(self) -> tuple[Shape, Shape]:
        """b and s of this run."""
        return (
            Shape(self, {((BATCH, 1),): 1}, self.values[BATCH]),
            Shape(self, {((SEQ, 1),): 1}, self.values[SEQ]),
        )

    def guard(self, terms: Terms, op: str) -> None:
        if not _always(terms, op):
            self.guards[(tuple(sorted(terms.items())), op)] = None

    def atom(self, terms: Terms, divisor: int, value: int) -> Shape:
        key = (tuple(sorted(terms.items())), divisor)
        index = self._atom_of.get(key)
        if index is None:
            self.atoms.append((terms, divisor))
            index = self._atom_of[key] = len(self.values)
            self.values.append(value)
        return Shape(self, {((index, 1),): 1}, value)


def _always(terms: Terms, op: str) -> bool:
    """Whether `terms op 0` holds at every b, s >= 1 (a polynomial in b and s alone whose
    non-constant coefficients share a sign is smallest, or largest, at b = s = 1)."""
    if any(var > SEQ for mono in terms for var, _ in mono):
        return False
    varying = [c for mono, c in terms.items() if mono != _CONSTANT]
    at_one = sum(terms.values())
    if all(c >= 0 for c in varying):  # terms >= at_one everywhere
        return (op == ">" and at_one > 0) or (op in (">=", "!=") and at_one >= (op == "!="))
    if all(c <= 0 for c in varying):  # terms <= at_one everywhere
        return (op == "<" and at_one < 0) or (op in ("<=", "!=") and at_one <= -(op == "!="))
    return False


def _times(a: Monomial, b: Monomial) -> Monomial:
    powers = dict(a)
    for var, power in b:
        powers[var] = powers.get(var, 0) + power
    return tuple(sorted(powers.items()))


def _plus(a: Terms, b: Terms, sign: int = 1) -> Terms:
    out = dict(a)
    for mono, c in b.items():
        total = out.get(mono, 0) + sign * c
        if total:
            out[mono] = total
        else:
            out.pop(mono, None)
    return out


class _Recorded:
    """A value of the traced run that text may be made from: formatting it marks the record,
    whose notes then hold at that shape only. Not hashable: a cache keyed by it would hide the
    shape."""

    __slots__ = ("trace", "value")
    __hash__ = None  # type: ignore[assignment]
    trace: Trace
    value: int | float

    def __format__(self, spec: str) -> str:
        self.trace.formatted = True
        return format(self.value, spec)

    def __str__(self) -> str:
        self.trace.formatted = True
        return str(self.value)


class Shape(_Recorded):
    """An integer that depends on the job's shape, with its value in the traced run."""

    __slots__ = ("terms",)
    value: int

    def __init__(self, trace: Trace, terms: Terms, value: int) -> None:
        self.trace = trace
        self.terms = terms
        self.value = value

    def _other(self, other: object) -> tuple[Terms, int] | None:
        if isinstance(other, Shape):
            if other.trace is not self.trace:
                raise TypeError("shapes of two runs mixed")
            return other.terms, other.value
        if isinstance(other, int):
            return ({_CONSTANT: int(other)} if other else {}), int(other)
        return None

    def _made(self, terms: Terms, value: int) -> Shape | int:
        if not terms or (len(terms) == 1 and _CONSTANT in terms):
            return value  # no longer depends on the shape
        return Shape(self.trace, terms, value)

    def __add__(self, other: object) -> Shape | int:
        found = self._other(other)
        if found is None:
            return NotImplemented
        return self._made(_plus(self.terms, found[0]), self.value + found[1])

    __radd__ = __add__

    def __sub__(self, other: object) -> Shape | int:
        found = self._other(other)
        if found is None:
            return NotImplemented
        return self._made(_plus(self.terms, found[0], -1), self.value - found[1])

    def __rsub__(self, other: object) -> Shape | int:
        found = self._other(other)
        if found is None:
            return NotImplemented
        return self._made(_plus(found[0], self.terms, -1), found[1] - self.value)

    def __neg__(self) -> Shape | int:
        return self._made({mono: -c for mono, c in self.terms.items()}, -self.value)

    def __pos__(self) -> Shape:
        return self

    def __mul__(self, other: object) -> Shape | int:
        found = self._other(other)
        if found is None:
            return NotImplemented
        terms: Terms = {}
        for mono_a, c_a in self.terms.items():
            for mono_b, c_b in found[0].items():
                mono = _times(mono_a, mono_b)
                total = terms.get(mono, 0) + c_a * c_b
                if total:
                    terms[mono] = total
                else:
                    terms.pop(mono, None)
        return self._made(terms, self.value * found[1])

    __rmul__ = __mul__

    def __floordiv__(self, other: object) -> Shape | int:
        if isinstance(other, Shape) or not isinstance(other, int) or other <= 0:
            return NotImplemented
        value = self.value // other
        if all(c % other == 0 for c in self.terms.values()):
            return self._made({mono: c // other for mono, c in self.terms.items()}, value)
        return self.trace.atom(dict(self.terms), int(other), value)

    def _compare(self, other: object, op: str) -> bool:
        found = self._other(other)
        if found is None:  # (a float or any other kind: not compared in the record)
            raise TypeError(f"a shape compared with {type(other).__name__}")
        difference = _plus(self.terms, found[0], -1)
        held = _HOLDS[op](self.value - found[1], 0)
        self.trace.guard(difference, op if held else _NEGATED[op])
        return held

    def __lt__(self, other: object) -> bool:
        return self._compare(other, "<")

    def __le__(self, other: object) -> bool:
        return self._compare(other, "<=")

    def __gt__(self, other: object) -> bool:
        return self._compare(other, ">")

    def __ge__(self, other: object) -> bool:
        return self._compare(other, ">=")

    def __eq__(self, other: object) -> bool:
        return self._compare(other, "==")

    def __ne__(self, other: object) -> bool:
        return self._compare(other, "!=")

    def __bool__(self) -> bool:
        return self._compare(0, "!=")

    def __truediv__(self, other: object) -> Measure:
        if isinstance(other, Shape) or not isinstance(other, int | float):
            return NotImplemented
        return Measure(self.trace, self.value / other)

    def __repr__(self) -> str:
        return f"Shape({self.value})"


class Measure(_Recorded):
    """A shape's bytes in other units (a GiB figure in a warning): text only. It formats as its
    value in the traced run and marks the record; any arithmetic on it raises TypeError, so it
    never reaches a byte count."""

    __slots__ = ()

    def __init__(self, trace: Trace, value: float) -> None:
        self.trace = trace
        self.value = value

    def __truediv__(self, other: object) -> Measure:
        if not isinstance(other, int | float) or isinstance(other, bool):
            return NotImplemented
        return Measure(self.trace, self.value / other)


def _var(index: int) -> str:
    return "b" if index == BATCH else "s" if index == SEQ else f"a{index}"


class _Source:
    """The generated function's lines; each product of variables is computed once, on the
    line before its first use (its factors are b, s and the divisions made before it)."""

    def __init__(self) -> None:
        self.lines = ["def shaped(b, s):"]
        self._products: dict[Monomial, str] = {}

    def line(self, text: str) -> None:
        self.lines.append(f"    {text}")

    def of(self, terms: Terms) -> str:
        if not terms:
            return "0"
        parts = []
        for mono, c in sorted(terms.items()):
            factors = [_var(var) for var, power in mono for _ in range(power)]
            if len(factors) > 1:
                name = self._products.get(mono)
                if name is None:
                    name = self._products[mono] = f"p{len(self._products)}"
                    self.line(f"{name} = {'*'.join(factors)}")
                factors = [name]
            parts.append("*".join([str(c), *factors]) if c != 1 or not factors else factors[0])
        return " + ".join(parts)


Compiled = Callable[[int, int], tuple[int, ...] | None]


def compile_record(trace: Trace, outputs: Sequence[Shape | int]) -> Compiled:
    """One function of (b, s): the `outputs` at that shape, or None where a guard of `trace`
    does not hold (the run took another branch there)."""
    source = _Source()
    for index, (terms, divisor) in enumerate(trace.atoms, start=SEQ + 1):
        source.line(f"a{index} = ({source.of(terms)}) // {divisor}")
    for key, op in trace.guards:
        source.line(f"if not ({source.of(dict(key))} {op} 0): return None")
    values = [source.of(o.terms) if isinstance(o, Shape) else str(int(o)) for o in outputs]
    source.line(f"return ({', '.join(values)},)")
    scope: dict[str, Any] = {}
    exec(compile("\n".join(source.lines), "<shaped step>", "exec"), scope)
    shaped: Compiled = scope["shaped"]
    return shaped


def is_shape(value: object) -> bool:
    return isinstance(value, Shape)
