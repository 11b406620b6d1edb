"""fused_tl.py: the fused kernels launched directly, without fused.py's launchers: expected rows, the flag pass's bits
and the exact counts of every observation == the torch reference (interpreter on CPU, real on CUDA)."""

import numpy as np
import pytest
import torch
from conftest import random_columns

from dcptool.dcp import reference
from dcptool.dcp.backend import load

pytestmark = pytest.mark.kernel
BLOCK = 128  # (smaller than fused.py's: observations of 129 and 300 rows take several steps)


@pytest.mark.parametrize("N,I,page", [(2, 1, 16), (4, 16, 1), (3, 5, 7)])
@pytest.mark.parametrize("has_pages", [True, False])
def test_kernels_launched_directly_match_reference(dev, N, I, page, has_pages):
    tl = load("dcptool.dcp.fused_tl")
    c = random_columns(np.random.default_rng(N * 100 + I), 40, N, I, page=page)
    keys = ("rows.seq_lens", "obs.rows", "rows.dcp_local_seq_lens", "obs.dcp_rows", "obs.num_reqs",
            "obs.num_reqs_padded", "obs.rank")
    seq, rows, dcp, drows, nreq, nrp, ranks = (torch.from_numpy(c[k]) for k in keys)
    kv = torch.from_numpy(c["rows.kv_pages"])
    n = nreq.numel()
    on = [x.to(dev) for x in (seq, rows.long(), dcp, drows.long(), nreq, nrp, ranks)]
    args = (*on, kv.to(dev) if has_pages else torch.zeros(1, dtype=torch.int32, device=dev))
    const = dict(DCP_SIZE=N, INTERLEAVE=I, PAGE=page, HAS_PAGES=has_pages, BLOCK=BLOCK)
    want = reference.check_rows(seq, rows, dcp, drows, nreq, nrp, ranks, N, I, kv_pages=kv if has_pages else None,
                                page_size=page)

    exp = torch.full((seq.numel(),), -7, dtype=torch.int32, device=dev)  # poisoned: every row is written
    tl.expected_rows_kernel[(n,)](exp, on[0], on[1], on[4], on[6], N, I, BLOCK=BLOCK)
    assert torch.equal(exp.cpu(), reference.expected_rows(seq, rows, nreq, ranks, N, I))

    flags = torch.full((n,), -7, dtype=torch.int32, device=dev)
    tl.flag_rows_kernel[(n,)](flags, *args, **const)
    bits = (want.n_wrong > 0).int() | (want.n_pad > 0).int() * 2 | (want.n_pages > 0).int() * 4
    assert torch.equal(flags.cpu(), bits) and bits.any()  # the planted errors are flagged, nothing else

    ids = torch.arange(n, device=dev)  # exact counts of every observation, flagged or not
    stats = torch.full((6 * n,), -7, dtype=torch.int32, device=dev)
    tl.check_rows_kernel[(n,)](stats, ids, n, *args, **const)
    assert torch.equal(stats.view(6, n).cpu(), want.stacked())
