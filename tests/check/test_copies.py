"""copies.py: host-copy on seeded random recordings against a torch reference (the rule read plainly, one
observation at a time), and on hand-built builds that must and must not be found."""

import numpy as np
import pytest
import torch

from dcptool.check.copies import check_host_copy
from dcptool.dump import Dump, DumpConfig, Observation, pack
from dcptool.dump.schema import validate_columns


def _dump(observations) -> Dump:
    cfg, cols = pack(observations, DumpConfig(dcp_size=2))
    validate_columns("t", cfg, cols)
    n = len(observations)
    return Dump(files=["t"], config=cfg, columns=cols, file_index=np.zeros(n, np.int32),
                file_obs=np.arange(n, dtype=np.int64))


def _obs(step, seq, nr, host=None, after=None):
    seq = np.asarray(seq)
    return Observation(step=step, site="attn_metadata", rank=0, num_reqs=nr, num_reqs_padded=seq.size, seq_lens=seq,
                       dcp_local_seq_lens=(seq + 1) // 2 * (np.arange(seq.size) < nr),
                       host_seq_lens=None if host is None else np.asarray(host, np.int32),
                       host_seq_lens_after=None if after is None else np.asarray(after, np.int32))


def _reference(o) -> tuple[str, int] | None:
    """(kind, first row) of the rule on one observation, in torch: the real rows of the host copy against what the
    build left of it, then against the device's lengths."""
    if o.host_seq_lens is None:
        return None
    h = torch.from_numpy(o.host_seq_lens.astype(np.int64))
    for kind, other in (("written-in-place", o.host_seq_lens_after), ("stale", o.seq_lens)):
        if other is None:
            continue
        b = torch.from_numpy(np.asarray(other, np.int64))
        k = min(o.num_reqs, h.numel(), b.numel())
        diff = torch.nonzero(h[:k] != b[:k])
        if diff.numel():
            return kind, int(diff[0])
    return None


@pytest.mark.parametrize("n", [0, 1, 127, 128, 129, 1000])
def test_random_recordings_match_the_reference(n):
    rng = np.random.default_rng(7 + n)
    observations = []
    for i in range(n):
        rows = int(rng.integers(1, 9))
        nr = int(rng.integers(0, rows + 1))
        seq = rng.integers(0, 500, rows)
        host = seq.copy() if rng.random() < 0.9 else None
        if host is not None and rng.random() < 0.2:
            host[rng.integers(0, rows)] += 3  # (stale: on a padded row it is no finding)
        after = None if host is None or rng.random() < 0.3 else host.copy()
        if after is not None and rng.random() < 0.2:
            after[rng.integers(0, rows)] -= 2
        observations.append(_obs(i, seq, nr, host, after))
    if not n:
        return
    want = {i: r for i, o in enumerate(observations) if (r := _reference(o)) is not None}
    found = {f.obs: f for f in check_host_copy(_dump(observations))}
    assert want or n < 100
    assert {i: (f.detail["kind"], f.row) for i, f in found.items()} == want


def test_a_stale_copy_and_an_in_place_write_are_found_and_a_faithful_copy_is_not():
    seq = [40, 33, 7, 0]
    d = _dump([_obs(0, seq, 3, seq, seq),  # read as the device has it, left alone
               _obs(1, seq, 3, [42, 33, 7, 0]),  # async scheduling: the copy counts 2 drafts the device does not
               _obs(2, seq, 3, seq, [40, 33, 2, 0]),  # a prefill row's query length (5) subtracted in place
               _obs(3, seq, 3, [40, 33, 7, 9]),  # (a padded row: not read as a length)
               _obs(4, seq, 3)])  # (no host copy recorded: nothing to check)
    found = list(check_host_copy(d))
    assert [(f.obs, f.detail["kind"], f.row, f.recorded, f.expected) for f in found] == [
        (1, "stale", 0, 42, 40), (2, "written-in-place", 2, 2, 7)]
    assert "in place" in found[1].message and "differs from the device's" in found[0].message
