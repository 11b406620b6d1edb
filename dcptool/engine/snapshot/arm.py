"""The snapshot ring's launches: the cheapest way (launch.py) that writes, on known values, what the snapshot kernels
should write, checked once per process and device."""

from __future__ import annotations

import numpy as np

from dcptool.engine.snapshot import kernels as K
from dcptool.engine.snapshot.launch import cheapest
from dcptool.engine.snapshot.layout import ABSENT, ARGS_NEG, ENTRY, FIXED, HEAD_READ, SECTIONS, head_struct
from dcptool.engine.snapshot.ring import SnapshotRing

_CHECKED: dict = {}  # CUDA device -> (go, how, go3, how3): the launches that proved themselves there


def arm(ring: SnapshotRing) -> None:
    """Give the ring its launches. On a GPU a one-time check (one synchronisation each) that a launch writes what
    the kernel should, trying the ways of launch.WAYS in launch.order(), then Triton's dispatch. The same for the
    fast path's kernel (_fast_launch; without a way cheaper than the dispatch observe() has no fast path). The CPU
    tests' host ring: Triton's dispatch, interpreted. Raises what fails (the Recorder then copies synchronously)."""
    device = ring.device
    if device is None:
        ring.go, ring.how = K.snapshot_dispatch, "the Triton interpreter"
        ring.go3, ring.how3 = K.snapshot_args_dispatch, "the Triton interpreter"
    elif device in _CHECKED:  # (checked once per process and device)
        ring.go, ring.how, ring.go3, ring.how3 = _CHECKED[device]
    else:
        torch = ring.torch
        with torch.cuda.device(device):
            ck = _self_check(ring, K.snapshot_dispatch)  # (compiles it)
            go, how, why = cheapest(ring, _self_check, ck, variadic=False)
            if go is None:
                go, how = K.snapshot_dispatch, f"Triton's dispatch ({'; '.join(why)})"
            elif why:
                how += f" ({'; '.join(why)})"
            ring.go, ring.how = go, how
            ring.go3, ring.how3 = _fast_launch(ring)
        _CHECKED[device] = (ring.go, ring.how, ring.go3, ring.how3)


def _self_check(ring: SnapshotRing, go):
    """Launch the kernel through `go` once on known values (unaligned, int64, an overflow, an absent section)
    and compare; returns what `go` returned (the compiled kernel, for Triton's dispatch)."""
    torch = ring.torch
    dev = ring.device
    a = torch.arange(1, 7, dtype=torch.int32, device=dev)[1:]  # an unaligned view: 2..6
    b = torch.tensor([7, -2, 2**40], dtype=torch.int64, device=dev)
    ring.np[:HEAD_READ] = -9
    head_struct(4).pack_into(ring.np, 0, 12345, -1, 5, 6, 4, 0, 40, 0, a.data_ptr(), 5, 2, 0, -1, 0, b.data_ptr(), 3,
                              1, a.data_ptr(), 5, 0)
    got = go(torch._C._cuda_getCurrentRawStream(dev), ring.base)
    torch.cuda.synchronize(dev)
    want = [12345, 12345, 5, 6, 4, 1, 40, 0]
    rows = [2, 3, 4, 5, 6, 7, -2, 0, 2, 3, 4, 5, 6]
    have = ring.np[:FIXED].tolist(), ring.np[FIXED + 4 * ENTRY:FIXED + 4 * ENTRY + len(rows)].tolist()
    if have != (want, rows):
        raise RuntimeError(f"snapshot kernel self-check wrote {have}")
    return got


def args_of(srcs: list, base: int) -> tuple[int, int, list]:
    """snapshot_args_kernel's section arguments for eight device tensors or None: (modes without K, row values in
    all, [address, count] * 8), an absent section as (base, -1): any readable address (the interpreter converts
    every address)."""
    modes, total, out = ARGS_NEG, 0, []
    for k, x in enumerate(srcs):
        if x is None:
            out += (base, -1)
        else:
            n = x.numel()
            modes |= (x.element_size() == 8) << k
            total += n
            out += (x.data_ptr(), n)
    return modes, total, out


def args_slot(srcs: list, seqno: int, nr: int, nrp: int, words: int, fill: int) -> np.ndarray:
    """The slot snapshot_args_kernel makes of eight host tensors (or None) in a ring filled with `fill`: the header
    the CPU would write for snapshot_kernel, the rows narrowed to int32, flags and done; the padding untouched."""
    k = len(SECTIONS)
    ent, rows, flags = [], [], 0
    for j, x in enumerate([*srcs, *([None] * (k - len(srcs)))]):
        if x is None:
            ent += ABSENT
            continue
        v = x.cpu().numpy().astype(np.int64).reshape(-1)
        ent += (x.data_ptr(), v.size, (x.element_size() == 8) | (2 * SECTIONS[j].nonneg))
        rows.append(v)
        flags |= int((v.astype(np.int32) != v).any()) | (2 * int(SECTIONS[j].nonneg and bool((v < 0).any())))
    rows = np.concatenate(rows) if rows else np.zeros(0, np.int64)
    out = np.full(FIXED + ENTRY * k + rows.size, fill, np.int32)
    head_struct(k).pack_into(out, 0, seqno, seqno, nr, nrp, k, flags, words, 0, *ent)
    out[FIXED + ENTRY * k:] = rows.astype(np.int32)
    return out


def _self_check_args(ring: SnapshotRing, go):
    """_self_check for the fast path's kernel (snapshot_args_kernel): one launch through `go` on known values (an
    unaligned view, absent sections, int64 sections, a negative where allowed, a value int32 cannot hold in the
    last of three programs) compared word by word with args_slot; returns what `go` returned."""
    torch = ring.torch
    dev = ring.device
    i32, i64 = torch.int32, torch.int64
    slot = torch.arange(1100, dtype=i64, device=dev) * 3
    slot[-1] = 2**40
    srcs = [torch.arange(1, 7, dtype=i32, device=dev)[1:], None,  # an unaligned view: 2..6
            torch.tensor([7, -2, 5, 2**31 - 1], dtype=i32, device=dev), None,
            torch.tensor([3, -4], dtype=i64, device=dev), None, torch.arange(1100, dtype=i64, device=dev), slot]
    modes, total, at = args_of(srcs, ring.base)
    k = len(SECTIONS)
    words = (FIXED + ENTRY * k + total + 7) & ~7
    grid = K.snapshot_args_grid(total)
    ring.np[:words + HEAD_READ] = -9
    ring.np[5] = 0  # (several programs: the CPU zeroes the flags word, as observe() does)
    got = go(ring.raw(dev), grid, ring.base, 12345, 5, 6, k << 16 | modes, words, *at)
    if dev is not None:
        torch.cuda.synchronize(dev)
    want = args_slot(srcs, 12345, 5, 6, words, -9)
    have = ring.np[:want.size + 1]
    if grid != 3 or not (np.array_equal(have[:-1], want) and have[-1] == -9):
        raise RuntimeError(f"snapshot_args_kernel self-check wrote {have[:FIXED].tolist()} ... (grid {grid})")
    return got


def _fast_launch(ring: SnapshotRing) -> tuple:
    """(go3, how3): the cheapest launch of snapshot_args_kernel that writes what it should (checked once, as
    arm does for snapshot_kernel), or (None, why) when no way of launch.WAYS does (observe() then has no fast
    path: through Triton's dispatch it would cost more than the general path; the CPU tests' host ring sets the
    dispatch itself)."""
    try:
        ck = _self_check_args(ring, K.snapshot_args_dispatch)  # (compiles it)
    except Exception as e:
        return None, f"none ({e!r})"
    go, how, why = cheapest(ring, _self_check_args, ck, variadic=True)
    return (go, how) if go is not None else (None, f"none, the general path instead ({'; '.join(why)})")


def every_way(ring: SnapshotRing) -> dict[str, tuple]:
    """Each way of launch.WAYS for both snapshot kernels on the ring's device, checked as arm() checks them (for the
    benchmark, which times them in one run): name -> (go, go3), or (None, why) where a way cannot launch them."""
    from dcptool.engine.snapshot.launch import WAYS, way

    out = {}
    with ring.torch.cuda.device(ring.device):
        ck = _self_check(ring, K.snapshot_dispatch)
        ck3 = _self_check_args(ring, K.snapshot_args_dispatch)
        for name in WAYS:
            try:
                go, go3 = way(name, ck, False), way(name, ck3, True)
                if go is None or go3 is None:
                    raise RuntimeError("not available here")
                _self_check(ring, go)
                _self_check_args(ring, go3)
                out[name] = (go, go3)
            except Exception as e:
                out[name] = (None, repr(e))
    return out
