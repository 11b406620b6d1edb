"""`dcptool export-test` against the installed vLLM (`make test-vllm`): the generated regression test calls
vLLM's own get_dcp_local_seq_lens, passes, and fails when an expected value is changed."""

import importlib.util

import numpy as np
import pytest
import torch
from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens

from dcptool.check.replay import replay
from dcptool.diagnose.export import export_test
from dcptool.dump import DumpConfig, Observation, open_dumps, write_observations

pytestmark = pytest.mark.vllm


def _load(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_exported_test_runs_on_vllms_function(tmp_path, monkeypatch):
    # N=4, I=2: a stale view (another observation's rows) and a None view
    seq = np.array([7, 33, 130, 0], np.int32)
    obs = [Observation(step=0, site="attn_metadata", rank=1, num_reqs=3, num_reqs_padded=4, seq_lens=seq,
                       dcp_local_seq_lens=None),
           Observation(step=1, site="attn_metadata", rank=2, num_reqs=3, num_reqs_padded=4, seq_lens=seq,
                       dcp_local_seq_lens=np.array([1, 9, 34, 0], np.int32))]
    p = tmp_path / "d.safetensors"
    write_observations(p, obs, DumpConfig(dcp_size=4, cp_interleave=2, engine_version="0.33.0"))
    d = open_dumps([str(p)])
    text, n = export_test(d, replay(d, "torch").findings)
    test = tmp_path / "test_gen.py"
    test.write_text(text)
    mod = _load(test)
    called = []
    real = get_dcp_local_seq_lens

    def spy(*a, **k):
        called.append(a)
        return real(*a, **k)

    monkeypatch.setattr("vllm.v1.attention.backends.utils.get_dcp_local_seq_lens", spy)
    for c in mod.VIEW_CASES:
        mod.test_dcp_local_seq_lens(c)
    assert n == 2 and len(called) == 2  # the file computed through vLLM's function
    lens = list(range(0, 300, 7))
    want = real(torch.tensor(lens, dtype=torch.int32), 4, 3, 2).tolist()
    assert mod.local_seq_lens(lens, 3) == want == [mod._formula(s, 3) for s in lens]
    case = mod.VIEW_CASES[0]
    bad = dict(case, expected=case["expected"][:-2] + [case["expected"][-2] + 1, 0])
    with pytest.raises(AssertionError):
        mod.test_dcp_local_seq_lens(bad)
