"""core.inputs: the sample count both edges' BalancedData check their inputs with."""

import numpy as np
import pytest

from hvd_balance.core.inputs import as_arrays, sample_count


def test_sample_count_of_an_array_and_of_a_dict_of_equal_arrays():
    assert sample_count(np.zeros((5, 3)), np.zeros(5)) == 5
    assert sample_count({"a": np.zeros((4, 2)), "b": [0, 1, 2, 3]}) == 4
    assert sorted(as_arrays({"b": [0, 1]})) == ["b"] and isinstance(as_arrays([1, 2]), np.ndarray)


@pytest.mark.parametrize("x, y, message", [
    ({}, None, "x is an empty dict"),
    ({"a": np.zeros(3), "b": np.zeros(4)}, None, "the inputs in x have different lengths: {'a': 3, 'b': 4}"),
    (np.zeros(3), np.zeros(5), "features and labels differ in length: len(x)=3, len(y)=5"),
])
def test_bad_inputs_are_refused_naming_the_lengths(x, y, message):
    with pytest.raises(ValueError) as err:
        sample_count(x, y)
    assert str(err.value) == message
