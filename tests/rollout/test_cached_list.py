"""CachedList: the array is handed back only while the list is untouched."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable

import numpy as np
import pytest

from rltool.rollout.cached_list import CachedList, cached_array, is_join
from rltool.rollout.state import RolloutState

# every mutating method of list, with a call that changes [3, 1, 2]
MUTATIONS: dict[str, Callable[[list], object]] = {
    "__setitem__": lambda x: x.__setitem__(0, 9),
    "__setitem__ slice": lambda x: x.__setitem__(slice(None), [7, 7, 7]),
    "__delitem__": lambda x: x.__delitem__(0),
    "__iadd__": lambda x: x.__iadd__([4]),
    "__imul__": lambda x: x.__imul__(2),
    "__init__": lambda x: x.__init__([5]),
    "append": lambda x: x.append(4),
    "extend": lambda x: x.extend([4]),
    "insert": lambda x: x.insert(0, 4),
    "pop": lambda x: x.pop(),
    "remove": lambda x: x.remove(1),
    "clear": lambda x: x.clear(),
    "sort": lambda x: x.sort(),
    "reverse": lambda x: x.reverse(),
}
READERS = {"copy", "count", "index"}  # list's public methods that leave it as it is


def test_every_list_mutator_is_covered() -> None:
    """A list method that is neither a known reader nor overridden would keep a stale array."""
    public = {name for name in vars(list) if not name.startswith("_")}
    mutators = {name.split()[0] for name in MUTATIONS}
    assert public - READERS <= mutators
    for name in mutators:
        assert name in vars(CachedList), name


def test_of_keeps_a_private_read_only_copy() -> None:
    source = np.array([[3, 1], [2, 5]])
    x = CachedList.of(source)
    source[0, 0] = 99
    assert x == [3, 1, 2, 5] and type(x[0]) is int
    a = cached_array(x)
    assert a is not None and a.tolist() == [3, 1, 2, 5] and not a.flags.writeable
    with pytest.raises(ValueError):
        a[0] = 1
    assert cached_array([3, 1, 2]) is None  # a plain list has none


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_any_mutation_drops_the_array(name: str) -> None:
    x = CachedList.of(np.array([3, 1, 2]))
    MUTATIONS[name](x)
    assert cached_array(x) is None
    assert x != [3, 1, 2]  # the mutation did happen


def test_join_shares_items_and_knows_its_parts() -> None:
    p, r = CachedList.of(np.array([10, 11])), CachedList.of(np.array([20, 21, 22]))
    whole = CachedList.join(p, r)
    assert whole == [10, 11, 20, 21, 22]
    assert whole[2] is r[0]  # items shared, as prompt + response would share them
    assert cached_array(whole).tolist() == [10, 11, 20, 21, 22]
    assert is_join(whole, p, r)
    assert not is_join(whole, r, p)  # order matters
    assert not is_join(whole, p, CachedList.of(np.array([20, 21, 22])))  # equal, not the same
    assert not is_join([10, 11, 20, 21, 22], p, r)


@pytest.mark.parametrize("which", ["part", "whole"])
def test_join_forgotten_after_a_mutation(which: str) -> None:
    p, r = CachedList.of(np.array([10, 11])), CachedList.of(np.array([20, 21, 22]))
    whole = CachedList.join(p, r)
    (r if which == "part" else whole)[0] = 7
    assert not is_join(whole, p, r)


def test_join_refuses_a_mutated_part() -> None:
    p = CachedList.of(np.array([1, 2]))
    p.append(3)
    with pytest.raises(ValueError, match="intact"):
        CachedList.join(p, CachedList.of(np.array([4])))


def test_pickle_and_copies_keep_values_and_a_fresh_array() -> None:
    p, r = CachedList.of(np.array([1, 2])), CachedList.of(np.array([3]))
    whole = CachedList.join(p, r)
    for other in (pickle.loads(pickle.dumps(whole)), copy.deepcopy(whole), copy.copy(whole)):
        assert type(other) is CachedList and other == [1, 2, 3]
        a = cached_array(other)
        assert a is not None and a.tolist() == [1, 2, 3] and not a.flags.writeable
        assert not np.shares_memory(a, cached_array(whole))
    assert is_join(copy.copy(whole), p, r)  # a shallow copy: joined from the same parts
    assert not is_join(copy.deepcopy(whole), p, r)  # a deep one: from copies of them
    mutated = CachedList.of(np.array([1, 2]))
    mutated.append(3)
    back = pickle.loads(pickle.dumps(mutated))
    assert back == [1, 2, 3] and cached_array(back) is None


def test_rollout_state_serialises_the_same() -> None:
    def state(ids: list[int]) -> RolloutState:
        s = RolloutState(rollout_id="a", group_id="g", prompt_ids=[1])
        s.input_ids = ids
        return s

    cached = state(CachedList.of(np.array([1, 2, 3])))
    assert cached.to_json() == state([1, 2, 3]).to_json()
    back = RolloutState.from_json(cached.to_json())
    assert back.input_ids == [1, 2, 3] and cached_array(back.input_ids) is None


def test_a_pickled_canonical_state_keeps_its_join() -> None:
    """Ray ships RolloutStates by pickle: the copy's input_ids is still, by construction,
    the join of the copy's own prompt and response lists."""
    s = RolloutState(rollout_id="a", group_id="g", prompt_ids=[])
    s.prompt_ids, s.response_ids = CachedList.of(np.array([1, 2])), CachedList.of(np.array([3]))
    s.input_ids = CachedList.join(s.prompt_ids, s.response_ids)
    for back in (pickle.loads(pickle.dumps(s)), copy.deepcopy(s)):
        assert back.input_ids == [1, 2, 3]
        assert is_join(back.input_ids, back.prompt_ids, back.response_ids)
        assert back.prompt_ids is not s.prompt_ids
    s.response_ids.append(4)  # mutated: the join no longer holds, nor after a pickle
    back = pickle.loads(pickle.dumps(s))
    assert not is_join(back.input_ids, back.prompt_ids, back.response_ids)
    assert back.input_ids == [1, 2, 3] and cached_array(back.input_ids).tolist() == [1, 2, 3]
