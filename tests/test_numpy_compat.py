"""NEP 50 (numpy 2): a Python int meeting an int32 column keeps int32, and wraps or raises OverflowError.

CI runs on numpy 2 (and `make test-oldest` on the oldest numpy pyproject.toml claims); these cases hold
on both. They pin the places where a sentinel or a product met a small-dtype column.
"""

import json
import warnings

from conftest import obs, write
from typer.testing import CliRunner

from dcptool.cli import app
from dcptool.diagnose.diff import diff
from dcptool.dump import open_dumps

RUNNER = CliRunner()


def test_diff_parent_sentinel_is_not_a_real_key(tmp_path):
    """A missing parent (-1) against a parent at step -2^62, site 0, rank 0, micro-batch 0, occurrence 0:
    the 'no parent' key sentinel used to be forced into the int32 columns: numpy 2.5 raises OverflowError
    (diff.py); numpy 2.4 silently wraps it to 0, a real rank and micro-batch."""
    far = -(2**62)
    common = [obs(step=far, ubatch=0), obs(step=7, parent=0)]
    a = write(tmp_path / "a.safetensors", [*common, obs(step=9)])
    b = write(tmp_path / "b.safetensors", [*common, obs(step=9, parent=0)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no silent wrap, no overflow warning on any numpy
        res = diff(open_dumps([a]), open_dumps([b]))
    assert res.by_field == {"parent": 1} and res.first.key.step == 9
    assert res.first.message == f"step 9 attn_metadata rank 0: parent: derived from none in A, from obs {b}:0 " \
                                f"(step {far} attn_metadata rank 0 ubatch 0) in B"
    r = RUNNER.invoke(app, ["diff", a, b, "--json"])
    assert r.exit_code == 1 and json.loads(r.stdout.splitlines()[-1])["by_field"] == {"parent": 1}
    assert diff(open_dumps([a]), open_dumps([a])).same
