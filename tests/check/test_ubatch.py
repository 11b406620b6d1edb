"""ubatch.py: a recorded micro-batch must be its parent sliced (the ubatch-slice rule)."""

import numpy as np
from conftest import expected_view, run, worked_example


def test_ubatch_slice_catches_an_untruncated_last_row(tmp_path):
    o = worked_example(False)
    o[1].seq_lens = np.array([64, 96, 512], np.int32)  # not reduced by the 5 tokens after the micro-batch
    o[1].dcp_local_seq_lens = expected_view(o[1].seq_lens, 3, 3, 2, 0)
    res = run(tmp_path, o)
    assert ("ubatch-slice" in [f.rule for f in res.findings])
    f = next(f for f in res.findings if f.rule == "ubatch-slice")
    assert (f.obs, f.detail["field"], f.row, f.recorded, f.expected) == (1, "seq_lens", 2, 512, 507)
