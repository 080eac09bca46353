"""nesting.depth against a recursive reference, on random JSON values and at the limit."""

import json
import random

import pytest

from conveyor import nesting


def reference(value) -> int:
    if isinstance(value, dict):
        return 1 + max((reference(v) for v in value.values()), default=0)
    if isinstance(value, (list, tuple)):
        return 1 + max((reference(v) for v in value), default=0)
    return 0


def random_value(rng: random.Random, budget: int):
    kind = rng.random()
    if budget <= 0 or kind < 0.3:
        return rng.choice([0, 1.5, "x", None, True])
    children = [random_value(rng, budget - rng.randint(1, 3)) for _ in range(rng.randint(0, 4))]
    if kind < 0.65:
        return children
    return {f"k{i}": child for i, child in enumerate(children)}


@pytest.mark.parametrize("seed", range(40))
def test_depth_equals_the_recursive_reference(seed):
    value = random_value(random.Random(seed), 12)
    want = reference(value)
    assert nesting.depth(value, 64) == want
    # At and just under the limit: the limit itself passes, one less is too deep.
    if want:
        assert nesting.depth(value, want) == want
        assert nesting.depth(value, want - 1) == want
        assert nesting.too_deep(value, want - 1) and not nesting.too_deep(value, want)


def test_depth_of_the_documented_examples():
    assert nesting.depth(7, 5) == 0
    assert nesting.depth({}, 5) == 1 and nesting.depth([], 5) == 1
    assert nesting.depth({"a": [1]}, 5) == 2
    assert nesting.depth([[], [[[]]], {}], 10) == 4


def test_a_deep_value_stops_the_walk_at_the_limit():
    value: list = []
    for _ in range(100_000):  # far past the interpreter's recursion limit
        value = [value, {"x": 1}]
    assert nesting.depth(value, 128) == 129
    assert nesting.too_deep(value, 128)


def test_loads_refuses_past_the_limit_and_reads_within_it():
    text = json.dumps([[[[1]]]])
    assert nesting.loads(text, 4) == [[[[1]]]]
    with pytest.raises(nesting.TooDeep):
        nesting.loads(text, 3)
    assert nesting.text_too_deep("[" * 5000 + "]" * 5000, 128)
    assert not nesting.text_too_deep("not json", 1)
