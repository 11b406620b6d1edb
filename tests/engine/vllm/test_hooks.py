"""The vLLM plugin's wrappers (hooks) against a fake vLLM: the view attention consumes, and the engine's own
errors."""

import json

from conftest import cli
from vllm_cases import CUT, run_case

BUFFER = """
# a capture path passing its whole buffer (8 rows) for 2 requests, as 0.29's DFlash capture does
buf = np.array([9, 13, 0, 0, 0, 0, 0, 0], np.int32)
out["results"].append(attn_utils.build_attn_metadata(
    [], 2, 2, None, np.array([0, 1, 2], np.int32), 1, np.array([17, 25, 0, 0, 0, 0, 0, 0], np.int32), 1, None, None,
    None, dcp_local_seq_lens=buf))
with plugin.step():
    out["results"].append(build(batch(), NONE))  # a padded batch, eager: attention reads 2 rows
"""


def test_records_the_view_attention_consumes(tmp_path):
    out = run_case(tmp_path, BUFFER, cut=CUT)
    d = out["dump"]
    assert out["results"] == [{"num_reqs": 2, "dcp": [9, 13]}] * 2
    assert [d.dcp_of(i).tolist() for i in range(2)] == [[9, 13], [9, 13]]
    assert [d.seq_lens_of(i).tolist() for i in range(2)] == [[17, 25], [17, 25]]
    assert d["obs.num_reqs_padded"].tolist() == [2, 2] and d["obs.num_reqs"].tolist() == [2, 2]
    p = cli("replay", "--backend", "torch", *out["files"], "--json")
    assert p.returncode == 0 and json.loads(p.stdout.splitlines()[-1])["findings"] == 0


def test_a_consumer_that_reads_the_whole_argument_is_recorded_whole(tmp_path):
    out = run_case(tmp_path, BUFFER)  # no [:num_reqs] in build_attn_metadata: attention would read all 8 rows
    d = out["dump"]
    assert d.dcp_of(0).tolist() == [9, 13, 0, 0, 0, 0, 0, 0] and d["obs.num_reqs_padded"].tolist() == [2, 4]
    p = cli("replay", "--backend", "torch", *out["files"], "--json")
    assert p.returncode == 1 and "shape" in p.stdout


def test_engine_errors_propagate_unchanged(tmp_path):
    body = """
    try:
        with plugin.step():
            build(batch(num_reqs=-1), NONE)
    except ValueError as e:
        out["errors"].append(str(e))
    out["results"].append(build(batch(), NONE))
    """
    out = run_case(tmp_path, body)
    assert out["errors"] == ["the engine's own error"] and out["results"] == [{"num_reqs": 2, "dcp": [9, 13]}]
    assert "disabled" not in out["stderr"]


def test_a_hybrid_models_group_lengths_are_what_each_groups_builder_reads(monkeypatch):
    """group_seq_lens: per KV-cache group, the local lengths where the group's builder runs DCP, the global ones where
    it does not; nothing where the groups are alike, a group has no builder, or the view is missing."""
    from types import SimpleNamespace

    import numpy as np
    import torch

    from dcptool.engine.vllm import hooks

    def group(dcp_world_size):
        return [SimpleNamespace(metadata_builders=[SimpleNamespace(dcp_world_size=dcp_world_size)])]

    sig = hooks.Sig(lambda attn_groups, seq_lens: None)
    monkeypatch.setattr(hooks.STATE, "kv_groups", [{"name": "a", "dcp": True}, {"name": "swa", "dcp": False}])
    for seq, view in ((np.array([9, 5]), np.array([5, 3])), (torch.tensor([9, 5]), torch.tensor([5, 3]))):
        kw = {"seq_lens": seq, "dcp_local_seq_lens": view}
        hooks._group_kwargs(sig, ([group(2), group(1)], seq), {}, kw)
        assert kw["group_seq_lens"].tolist() == [5, 3, 9, 5] and type(kw["group_seq_lens"]) is type(seq)
    for groups, view in (([group(2), []], np.array([5, 3])), ([group(2), group(2)], None), ([group(2)], [5, 3])):
        kw = {"seq_lens": np.array([9, 5]), "dcp_local_seq_lens": view}
        hooks._group_kwargs(sig, (groups, None), {}, kw)
        assert "group_seq_lens" not in kw
    monkeypatch.setattr(hooks.STATE, "kv_groups", [{"name": "a", "dcp": True}, {"name": "b", "dcp": True}])
    kw = {"seq_lens": np.array([9, 5]), "dcp_local_seq_lens": np.array([5, 3])}
    hooks._group_kwargs(sig, ([group(2), group(2)], None), {}, kw)
    assert "group_seq_lens" not in kw  # (alike groups: the view is the whole story)
