"""``LruPolicy`` driven by random insert/touch/remove sequences against a list-based reference."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from neuralcache import cache_policy
from neuralcache.cache_policy import LruPolicy

CAPACITY = 100
GROUPS = 3
keys = st.integers(0, 15)
# Sizes up to a bit over the capacity, so oversized inserts are exercised too.
sizes = st.integers(1, CAPACITY + 10)


class LruReference:
    """The obvious LRU: a list of (key, size), least recently used first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.items: list[tuple[int, int]] = []

    def used(self) -> int:
        return sum(size for _, size in self.items)

    def remove(self, key: int) -> bool:
        before = len(self.items)
        self.items = [(k, s) for k, s in self.items if k != key]
        return len(self.items) != before

    def touch(self, key: int) -> None:
        for k, s in self.items:
            if k == key:
                self.remove(key)
                self.items.append((k, s))
                return

    def insert(self, key: int, size: int) -> list[int]:
        self.remove(key)
        if size > self.capacity:
            return [key]
        evicted = []
        while self.used() + size > self.capacity:
            evicted.append(self.items.pop(0)[0])
        self.items.append((key, size))
        return evicted


class LruMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.policy = LruPolicy(CAPACITY, group_of=_group)
        self.model = LruReference(CAPACITY)

    @rule(key=keys, size=sizes)
    def insert(self, key: int, size: int) -> None:
        assert self.policy.insert(key, size) == self.model.insert(key, size)

    @rule(items=st.lists(st.tuples(keys, sizes), max_size=5))
    def insert_many(self, items: list[tuple[int, int]]) -> None:
        expected = [old for key, size in items for old in self.model.insert(key, size)]
        assert self.policy.insert_many(items) == expected

    @rule(key=keys)
    def touch(self, key: int) -> None:
        self.policy.touch(key)
        self.model.touch(key)

    @rule(touched=st.lists(keys, max_size=6))
    def touch_many(self, touched: list[int]) -> None:
        held = [k for k in touched if k in self.policy]
        assert self.policy.touch_many(touched) == held
        for key in touched:
            self.model.touch(key)

    @rule(touched=st.lists(keys, max_size=6))
    def touch_later(self, touched: list[int]) -> None:
        self.policy.touch_later(touched)
        for key in touched:
            self.model.touch(key)

    @rule(touched=st.lists(keys, max_size=6), removed=st.lists(keys, max_size=3), key=keys,
          size=sizes)
    def touch_later_then_remove_and_insert(self, touched: list[int], removed: list[int],
                                           key: int, size: int) -> None:
        """The moves put off are made before the insert, and skip the keys removed
        meanwhile (the invariants below would make them at once, after each rule)."""
        self.policy.touch_later(touched)
        for k in touched:
            self.model.touch(k)
        for k in removed:
            assert self.policy.remove(k) == self.model.remove(k)
        assert self.policy.insert(key, size) == self.model.insert(key, size)

    @rule(key=keys)
    def remove(self, key: int) -> None:
        assert self.policy.remove(key) == self.model.remove(key)

    @invariant()
    def same_contents_in_the_same_order(self) -> None:
        held = [k for k, _ in self.model.items]
        assert list(self.policy.oldest_first()) == held
        assert len(self.policy) == len(held)
        assert all(k in self.policy and self.policy.holds(k) for k in held)

    @invariant()
    def used_is_exact_and_bounded(self) -> None:
        assert self.policy.used == self.model.used() <= CAPACITY

    @invariant()
    def each_group_counts_its_held_keys(self) -> None:
        for group in range(GROUPS):
            assert self.policy.held_in(group) == sum(_group(k) == group
                                                     for k, _ in self.model.items)


def _group(key: int) -> int:
    return key % GROUPS


TestLruPolicy = LruMachine.TestCase
TestLruPolicy.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_touches_put_off_past_the_bound_are_made_oldest_first(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cache_policy, "TOUCHES_LATER_MAX", 4)
    policy = LruPolicy(CAPACITY)
    policy.insert_many([(k, 1) for k in range(6)])
    policy.touch_later([0, 1])
    policy.touch_later([2, 3])
    assert list(policy._sizes) == [0, 1, 2, 3, 4, 5]  # nothing moved yet
    policy.touch_later([4])  # five keys held back: the oldest run's are moved
    assert list(policy._sizes) == [2, 3, 4, 5, 0, 1]
    assert list(policy.oldest_first()) == [5, 0, 1, 2, 3, 4]


@pytest.mark.parametrize("capacity", [0, -1])
def test_capacity_must_be_positive(capacity: int) -> None:
    with pytest.raises(ValueError):
        LruPolicy(capacity)


def test_without_a_grouping_every_key_is_in_group_none() -> None:
    policy = LruPolicy(10)
    policy.insert_many([("a", 1), ("b", 1)])
    policy.remove("a")
    assert policy.held_in(None) == 1


def test_an_oversized_insert_drops_the_older_copy_of_its_key() -> None:
    policy = LruPolicy(10)
    policy.insert("a", 4)
    assert policy.insert("a", 11) == ["a"]
    assert "a" not in policy and policy.used == 0
