"""check_prompt_ids: a list of Python ints takes a C-level path (min/max, no array); every kind of input must get the
same answer from it as from the array path: the ids as a list of ints, or InvalidRequest naming the first bad id."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.request_validation import InvalidRequest, check_prompt_ids

VOCAB = 1000


def reference(ids, vocab_size):
    """What check_prompt_ids promises, written plainly."""
    if len(ids) == 0:
        raise InvalidRequest("empty")
    for token in ids:
        if not 0 <= token < vocab_size:
            raise InvalidRequest(f"contains token id {token}, outside")
    return [int(t) for t in ids]


def same_answer(ids):
    try:
        expected = reference(ids, VOCAB)
    except InvalidRequest as e:
        with pytest.raises(InvalidRequest) as got:
            check_prompt_ids(ids, VOCAB)
        assert ("empty" in str(e)) == ("must not be empty" in got.value.message)
        if "empty" not in str(e):
            assert str(e).split(",")[0] in got.value.message  # the first bad id, as the array path names it
        return
    result = check_prompt_ids(ids, VOCAB)
    assert result == expected and all(type(t) is int for t in result)
    assert result is not ids  # a copy: the caller's list is its own


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=-5, max_value=VOCAB + 5), max_size=40))
def test_lists_of_ints_in_and_out_of_the_vocabulary(ids):
    same_answer(ids)


@pytest.mark.parametrize(
    "ids",
    [
        [1, True, 3],  # a bool is not an int here: the array path decides
        [np.int64(5), 7],
        np.array([1, 2, 999]),
        (4, 5, 6),
        [1, 2**70],  # beyond int64
        [0, VOCAB - 1],
        [VOCAB],
    ],
)
def test_other_kinds_of_input(ids):
    same_answer(ids)
