"""rows.py: a batch padded as attention metadata sees it, and vLLM's dummy batches."""

import numpy as np
import pytest

from dcptool.model.rows import dummy_rows, make_rows, num_decodes


def test_make_rows_pads_requests_and_tokens():
    r = make_rows(np.array([3, 1]), np.array([10, 5]), 4, 2)
    assert r.seq.tolist() == [10, 5, 0, 0] and r.qsl.tolist() == [0, 3, 4, 4, 4]  # padded entries repeat the count
    assert (r.nr, r.nrp, r.ntp) == (2, 4, 4)  # at least the real tokens
    assert make_rows(np.array([3, 1]), np.array([10, 5]), 2, 8).ntp == 8


def test_dummy_rows_spread_tokens_as_make_dummy_then_add_the_context():
    r = dummy_rows(3, 8, 0, 1000)
    assert np.diff(r.qsl).tolist() == [2, 3, 3] and r.seq.tolist() == [2, 3, 3]  # the last ones get one more
    assert dummy_rows(3, 8, 100, 1000).seq.tolist() == [102, 103, 103]
    assert dummy_rows(3, 8, 100, 102).seq.tolist() == [102, 102, 102]  # the context stops at max_model_len


@pytest.mark.parametrize("n", [0, 1, 127, 128, 129, 1000])
@pytest.mark.parametrize("threshold", [1, 3])
def test_num_decodes_is_the_rows_before_the_first_longer_query(n, threshold):
    rng = np.random.default_rng(n + threshold)
    q = rng.integers(0, threshold + 3, n)
    want = next((i for i, v in enumerate(q.tolist()) if v > threshold), n)
    assert num_decodes(q, threshold, n) == want
    assert num_decodes(np.minimum(q, threshold), threshold, n + 5) == n + 5  # no row longer: the given count
