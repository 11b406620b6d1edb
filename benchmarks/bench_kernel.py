"""Fused check kernel bandwidth against a device-to-device copy of the same bytes, in one run (GPU).

    python benchmarks/bench_kernel.py [--rows 64e6,256e6]

Bytes the kernel must move: every seq_lens row and every recorded DCP row read once (4 + 4 bytes
per row) plus the per-observation offsets and counts; the copy moves the same number of bytes
(read + write). Prints the median times (triton.testing.do_bench), the bandwidths and the ratio,
for a few block sizes, and checks the kernel's answer against the torch reference on a sample.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dcptool.dcp import fused  # noqa: E402
from dcptool.dcp.reference import check_rows as ref_check  # noqa: E402


def make(rows_total: int, N: int = 4, I: int = 16, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    lens = torch.tensor([64, 128, 192, 256, 320, 384, 448, 512], device="cuda")
    n = rows_total // 288
    ln = lens[torch.randint(0, 8, (n,), device="cuda", generator=g)]
    rows = torch.zeros(n + 1, dtype=torch.int64, device="cuda")
    rows[1:] = torch.cumsum(ln, 0)
    R = int(rows[-1])
    seq = torch.randint(1, 1 << 17, (R,), device="cuda", dtype=torch.int32, generator=g)
    nr = (ln - torch.randint(0, 8, (n,), device="cuda", generator=g)).to(torch.int32)
    ranks = torch.randint(0, N, (n,), device="cuda", dtype=torch.int32, generator=g)
    exp = fused.expected_rows(seq, rows, nr, ranks, N, I)
    return seq, rows, exp, rows.clone(), nr, ln.to(torch.int32), ranks, N, I


# (rows per step, warps) of the flag pass; the default is fused.FUSED_BLOCK / FUSED_WARPS
CONFIGS = [(256, 2), (128, 2), (256, 4), (512, 2)]


def bench(R: int) -> None:
    import triton

    seq, rows, dcp, drows, nr, nrp, ranks, N, I = make(R)
    n = nr.numel()
    moved = seq.numel() * 4 + dcp.numel() * 4 + n * (8 + 8 + 4 + 4 + 4) + 6 * n * 4
    src = torch.empty(moved // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=400, return_mode="median")
    copy_bw = moved / copy_ms / 1e6
    dcp[::997] += 1  # planted wrong rows: the answer is checked below
    stats = fused.check_rows(seq, rows, dcp, drows, nr, nrp, ranks, N, I)
    k = min(n, 2000)
    want = ref_check(seq[: rows[k]].cpu(), rows[: k + 1].cpu(), dcp[: drows[k]].cpu(), drows[: k + 1].cpu(),
                     nr[:k].cpu(), nrp[:k].cpu(), ranks[:k].cpu(), N, I)
    assert torch.equal(stats[:4, :k].cpu(), want[:4]), "kernel disagrees with the reference"
    assert int(stats[0].sum()) > 0
    default = (fused.FUSED_BLOCK, fused.FUSED_WARPS)
    for block, warps in CONFIGS:
        fused.FUSED_BLOCK, fused.FUSED_WARPS = block, warps
        got = fused.check_rows(seq, rows, dcp, drows, nr, nrp, ranks, N, I)
        assert torch.equal(got, stats), (block, warps)
        ms = triton.testing.do_bench(lambda: fused.check_rows(seq, rows, dcp, drows, nr, nrp, ranks, N, I),
                                     warmup=50, rep=400, return_mode="median")
        bw = moved / ms / 1e6
        print(f"| {seq.numel() / 1e6:.0f}M | {n:,} | {ms:.3f} | {bw:.0f} | {copy_ms:.3f} | {copy_bw:.0f} | "
              f"{bw / copy_bw:.2f} | {block} rows, {warps} warps |", flush=True)
    fused.FUSED_BLOCK, fused.FUSED_WARPS = default


def main() -> None:
    import triton

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="64e6,256e6")
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    print("| rows | obs | kernel ms | kernel GB/s | copy ms | copy GB/s | kernel/copy | tile |")
    print("|---|---|---|---|---|---|---|---|")
    for R in [int(float(x)) for x in args.rows.split(",")]:
        bench(R)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
