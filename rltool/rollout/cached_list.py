"""CachedList: a list of numbers that keeps the numpy array it was built from.

The step-level conversion reads every token field of every sample into numpy
arrays; reading Python numbers one at a time is most of its cost. An agent loop
that builds a field from an array already holds that array: ``CachedList.of``
keeps a read-only copy beside the list, and ``cached_array`` hands it back, so
the conversion copies memory instead of reading a million Python ints.

Correct by construction, not by convention:

- the array is built from the same values as the list, and is read-only;
- every list method that mutates drops the array before it runs, so an
  in-place edit (the staleness bake clears labels in place) is never read
  stale: the conversion falls back to reading the list;
- assigning a new list to a RolloutState field replaces the object, cache and
  all; pydantic validation (``RolloutState(...)``, ``from_json``) builds plain
  lists, which simply have no cache;
- pickling (Ray transport) ships the array and rebuilds the list from it, or
  ships the parts of a join and joins them again, so that a RolloutState
  arrives with its input_ids still the join of its prompt and response lists;
  copying goes through the same path.

The one way around the hook is C code that writes into a list's internals
without calling its methods (``heapq`` does, on any list); nothing in rltool
applies such code to token fields.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import chain
from typing import Any, SupportsIndex

import numpy as np


class CachedList(list):
    """A plain list to every reader; ``cached_array`` returns its array until it is mutated."""

    __slots__ = ("_array", "_parts")

    def __init__(self, values: Iterable[Any] = ()) -> None:
        self._array: np.ndarray | None = None
        self._parts: tuple[CachedList, ...] = ()  # what ``join`` built this list from
        super().__init__(values)

    @classmethod
    def of(cls, array: np.ndarray) -> CachedList:
        """A list of ``array``'s values (flattened) that keeps a read-only copy of it."""
        owned = np.array(array, copy=True).reshape(-1)  # our own memory: no one else can write it
        owned.flags.writeable = False
        out = cls(owned.tolist())
        out._array = owned
        return out

    @classmethod
    def join(cls, *parts: CachedList) -> CachedList:
        """``parts`` concatenated; the list shares their items, the array is their arrays joined."""
        arrays = [p._array for p in parts]
        if any(a is None for a in arrays):
            raise ValueError("CachedList.join needs parts whose array is intact (not mutated)")
        if len({a.dtype for a in arrays}) > 1:  # concatenate would cast, ints to floats
            raise ValueError(f"CachedList.join of dtypes {sorted({str(a.dtype) for a in arrays})}")
        out = cls(chain.from_iterable(parts))
        out._array = np.concatenate(arrays)  # a new array: ours alone
        out._array.flags.writeable = False
        out._parts = parts
        return out

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        if self._array is None:
            return list, (list(self),)
        if self._parts and is_join(self, *self._parts):
            # pickled with its parts (a RolloutState holds them): the copy is their join
            return CachedList.join, self._parts
        return CachedList.of, (self._array,)

    # every mutating method of list: drop the array, then mutate
    def __setitem__(self, key: Any, value: Any) -> None:
        self._array, self._parts = None, ()
        super().__setitem__(key, value)

    def __delitem__(self, key: Any) -> None:
        self._array, self._parts = None, ()
        super().__delitem__(key)

    def __iadd__(self, values: Iterable[Any]) -> CachedList:  # type: ignore[override,misc]
        self._array, self._parts = None, ()
        return super().__iadd__(values)

    def __imul__(self, n: SupportsIndex) -> CachedList:  # type: ignore[override,misc]
        self._array, self._parts = None, ()
        return super().__imul__(n)

    def append(self, value: Any) -> None:
        self._array, self._parts = None, ()
        super().append(value)

    def extend(self, values: Iterable[Any]) -> None:
        self._array, self._parts = None, ()
        super().extend(values)

    def insert(self, index: SupportsIndex, value: Any) -> None:
        self._array, self._parts = None, ()
        super().insert(index, value)

    def pop(self, index: SupportsIndex = -1) -> Any:
        self._array, self._parts = None, ()
        return super().pop(index)

    def remove(self, value: Any) -> None:
        self._array, self._parts = None, ()
        super().remove(value)

    def clear(self) -> None:
        self._array, self._parts = None, ()
        super().clear()

    def sort(self, *args: Any, **kwargs: Any) -> None:
        self._array, self._parts = None, ()
        super().sort(*args, **kwargs)

    def reverse(self) -> None:
        self._array, self._parts = None, ()
        super().reverse()


def cached_array(values: Any) -> np.ndarray | None:
    """The read-only array a CachedList was built from, or None (a plain list, or mutated since)."""
    return values._array if type(values) is CachedList else None


def is_join(whole: Any, *parts: Any) -> bool:
    """True when ``whole`` is, by construction, ``parts`` concatenated: ``CachedList.join``
    built it from these very objects and none of them has been mutated since (a list
    that lost its array never gets one back). False says nothing: compare the values."""
    if type(whole) is not CachedList or whole._array is None or len(whole._parts) != len(parts):
        return False
    # a plain loop: all() over a generator costs 4x on this per-sample path
    for p, q in zip(parts, whole._parts, strict=True):
        if p is not q or q._array is None:
            return False
    return True
