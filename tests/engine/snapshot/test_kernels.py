"""The snapshot kernels (kernels.py, kernels_tl.py), launched directly: the slot the descriptor kernel writes, its
flags, and the fast path's kernel writing the same slot from its arguments. Under TRITON_INTERPRET=1 on a CPU."""

import os

import numpy as np
import pytest
import torch

from dcptool.engine.snapshot.layout import ENTRY, FIXED, HEAD_READ, MAX_SECTIONS, SECTIONS, head_struct, slot_rows


def _kernel_device() -> str:
    return "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def _launch_slot(secs: list[tuple], seqno: int = 41, nr: int = 3, nrp: int = 5, pad: int = 64):
    """Write a slot header describing `secs` (tensor or None, negatives flagged) into a ring, launch the
    kernel with the slot's address only, and return the ring's words (numpy) and the slot's words."""
    from dcptool.engine.snapshot.kernels import snapshot_dispatch

    ent, words = [], FIXED + ENTRY * len(secs)
    for t, nonneg in secs:
        if t is None:
            ent += (0, -1, 0)
        else:
            ent += (t.data_ptr(), t.numel(), (t.dtype == torch.int64) | (2 if nonneg else 0))
            words += t.numel()
    words = (words + 7) & ~7
    dev = _kernel_device()
    ring = torch.full((words + HEAD_READ + pad,), -7, dtype=torch.int32, device=dev)
    host = np.full(ring.numel(), -7, np.int32)
    head_struct(len(secs)).pack_into(host, 0, seqno, -1, nr, nrp, len(secs), 0, words, 0, *ent)
    ring.copy_(torch.from_numpy(host))  # (on a GPU the header is written to device memory here; same reads)
    snapshot_dispatch(0, ring.data_ptr())
    return ring.cpu().numpy(), words


@pytest.mark.kernel
@pytest.mark.parametrize("n", [0, 1, 127, 128, 129, 1000, 1537])
def test_snapshot_slot_read_back_equals_the_sources(n):
    """The descriptor launch: the header the CPU wrote (seqno, num_reqs, num_reqs_padded, K, words and one
    entry per section) stays, `done` becomes the seqno, flags 0, and the rows are the sources back to back
    in section order (an int64 source narrowed, an unaligned view, absent sections taking no room), for
    every section length around the kernel's block; nothing past the slot is written."""
    from dcptool.engine.snapshot.kernels import SNAP_BLOCK

    assert SNAP_BLOCK == 512 and len(SECTIONS) <= MAX_SECTIONS
    dev = _kernel_device()
    g = torch.Generator().manual_seed(n)
    seq = torch.randint(0, 1 << 30, (n,), generator=g, dtype=torch.int32).to(dev)
    wide = torch.randint(-(1 << 31), 1 << 31, (n + 1,), generator=g, dtype=torch.int64).to(dev)  # fits int32
    base = torch.arange(n + 3, dtype=torch.int32, device=dev)
    view = base[3:]  # unaligned: 12 bytes into its storage
    got, words = _launch_slot([(seq, True), (None, False), (wide, False), (view, False), (None, True)], seqno=n)
    hdr = got[:FIXED].tolist()
    assert hdr == [n, n, 3, 5, 5, 0, words, 0]
    counts = got[FIXED:FIXED + 5 * ENTRY].reshape(5, ENTRY)[:, 2].tolist()
    assert counts == [n, -1, n + 1, n, -1]
    rows = slot_rows(got, 0, None)
    assert rows[1] is None and rows[4] is None
    assert np.array_equal(rows[0], seq.cpu().numpy()) and np.array_equal(rows[2], wide.cpu().numpy())
    assert np.array_equal(rows[3], np.arange(3, n + 3))
    end = FIXED + 5 * ENTRY + 3 * n + 1
    assert (got[end:] == -7).all()  # nothing past the slot's rows


@pytest.mark.kernel
def test_snapshot_flags_values_int32_cannot_hold_and_forbidden_negatives():
    dev = _kernel_device()
    ok = torch.arange(1, 200, dtype=torch.int32, device=dev)
    big = torch.tensor([5, 2**33 + 7, 6], dtype=torch.int64, device=dev)
    neg = torch.tensor([4, -1], dtype=torch.int32, device=dev)
    got, _ = _launch_slot([(ok, True), (big, False)])
    assert got[5] == 1 and got[1] == 41  # bit 0; done still written
    assert slot_rows(got, 0, None)[1].tolist() == [5, 7, 6]  # narrowed (wrapped); the harvest drops it
    got, _ = _launch_slot([(neg, True), (ok, False)])
    assert got[5] == 2  # bit 1: a negative where the section forbids them
    got, _ = _launch_slot([(ok, True), (neg, False)])
    assert got[5] == 0  # a -1 in a view is a finding to record, not a bad value
    got, _ = _launch_slot([(neg, True), (big, False)])
    assert got[5] == 3


# --------------------------------------------------------------------------------------------
# observe()'s fast path: the engine's call, the header as kernel arguments

def _launch_args(secs: list, seqno: int = 41, nr: int = 3, nrp: int = 5, pad: int = 64):
    """snapshot_args_kernel on up to eight sections (tensors, or None: absent) into a fresh ring filled with -7, as
    observe()'s fast path launches it (on snapshot_args_grid programs; with several, the flags word zeroed first);
    returns the ring's words (numpy), the slot's words and the grid."""
    from dcptool.engine.snapshot.arm import args_of
    from dcptool.engine.snapshot.kernels import snapshot_args_dispatch, snapshot_args_grid

    k = len(SECTIONS)
    secs = [*secs, *([None] * (8 - len(secs)))]
    words = (FIXED + ENTRY * k + sum(t.numel() for t in secs if t is not None) + 7) & ~7
    ring = torch.full((words + HEAD_READ + pad,), -7, dtype=torch.int32, device=_kernel_device())
    modes, total, at = args_of(secs, ring.data_ptr())
    grid = snapshot_args_grid(total)
    if grid > 1:
        ring[5] = 0
    snapshot_args_dispatch(0, grid, ring.data_ptr(), seqno, nr, nrp, k << 16 | modes, words, *at)
    return ring.cpu().numpy(), words, grid


def _sections(n: int, g: torch.Generator, dev: str) -> list:
    """Eight sections as an engine hands them: unaligned int32 seq_lens, a DCP view with negatives (allowed),
    query_start_loc, kv_pages, int64 dcp_query_start_loc and dcp_tot_seq_lens, int64 positions and a [2, n]
    int64 slot mapping with -1s; every value fits int32."""
    i32, i64 = torch.int32, torch.int64
    return [torch.randint(0, 1 << 30, (n + 1,), generator=g, dtype=i32).to(dev)[1:],
            torch.randint(-5, 1 << 20, (n,), generator=g, dtype=i32).to(dev),
            torch.arange(n + 1, dtype=i32, device=dev), torch.randint(0, 99, (n,), generator=g, dtype=i32).to(dev),
            torch.arange(n + 1, dtype=i64, device=dev) * 2, torch.randint(0, 1 << 30, (n,), generator=g,
                                                                           dtype=i64).to(dev),
            torch.randint(0, 1 << 20, (n,), generator=g, dtype=i64).to(dev),
            torch.randint(-1, 1 << 30, (2, n), generator=g, dtype=i64).to(dev)]


@pytest.mark.kernel
@pytest.mark.parametrize("n", [0, 1, 127, 300, 1025])
def test_the_args_kernel_writes_the_slot_the_descriptor_kernel_writes(n):
    """The fast path's kernel takes the header as arguments and writes it itself: word for word the slot that
    the CPU's header and snapshot_kernel make (header, rows, flags, done; nothing past the slot), with sections
    absent, int64 sections narrowed, on one program or several (lengths around its block of 1,024 values;
    empty sections: the same but for the address words, which the interpreter cannot take as 0)."""
    dev = _kernel_device()
    g = torch.Generator().manual_seed(n)
    full = _sections(n, g, dev)
    cases = [full[:3], [full[0], None, full[2]], [full[0], full[1]], [full[0]], full,
             [full[0], None, None, None, None, full[5], full[6], full[7]]]
    for secs in cases:
        got, words, grid = _launch_args(secs, seqno=n + 3)
        flags = [(t, SECTIONS[k].nonneg) for k, t in enumerate(secs)]
        flags += [(None, False)] * (len(SECTIONS) - len(secs))
        want, want_words = _launch_slot(flags, seqno=n + 3)
        if n == 0:
            addr = FIXED + ENTRY * np.arange(len(SECTIONS))[:, None] + np.arange(2)
            got[addr], want[addr] = 0, 0
        assert words == want_words and np.array_equal(got, want), ([t is None for t in secs], grid)
        assert got[1] == n + 3 and got[5] == 0
        assert grid == max(1, -(-sum(t.numel() for t in secs if t is not None) // 1024))


@pytest.mark.kernel
@pytest.mark.parametrize("sec,at", [("pos", 0), ("pos", 1400), ("slot", 1499)])  # programs 0, 1 and 2
def test_the_args_kernel_flags_like_the_descriptor_kernel(sec, at):
    """Bit 1 for a negative where the section forbids them (seq_lens, dcp_tot_seq_lens, positions), bit 0 for a
    value int32 cannot hold, found by whichever of three programs holds it; negatives allowed elsewhere."""
    dev = _kernel_device()
    ok = torch.arange(1, 9, dtype=torch.int32, device=dev)
    neg = torch.tensor([4, -1, 3, 2, 1, 0, 5, 6], dtype=torch.int32, device=dev)
    assert _launch_args([neg, ok])[0][5] == 2  # a negative seq_len: bit 1
    assert _launch_args([ok, neg, torch.full((9,), -3, dtype=torch.int32, device=dev)])[0][5] == 0  # allowed there
    pos = torch.arange(1500, dtype=torch.int64, device=dev)
    slot = torch.arange(1500, dtype=torch.int64, device=dev)
    clean, _, grid = _launch_args([ok, None, None, None, None, None, pos, slot])
    assert clean[5] == 0 and grid == 3
    if sec == "pos":
        pos[at] = -4
        want = 2
    else:
        slot[at] = 2**35 + 1
        want = 1
    got, _, _ = _launch_args([ok, None, None, None, None, None, pos, slot])
    assert got[5] == want and got[1] == 41
    rows = slot_rows(got, 0, None)
    assert np.array_equal(rows[6], pos.cpu().numpy().astype(np.int32))  # copied all the same (the harvest drops it)
    assert np.array_equal(rows[7], slot.cpu().numpy().astype(np.int32))
