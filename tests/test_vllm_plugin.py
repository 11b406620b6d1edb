"""The vLLM plugin's mechanics against a fake vLLM (no vLLM needed): gating, hooks, never breaking the engine.

Each case runs in a fresh interpreter, as vLLM's worker processes do, with a small fake `vllm`
package on the path that has model runner V2's hooked functions with their real signatures.
What the plugin records from vLLM's real code is tested in tests/vllm (make test-vllm).
"""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
from conftest import ROOT, cli

from dcptool.dump import open_dumps

FAKE = {
    "vllm/__init__.py": "__version__ = {version!r}\n",
    "vllm/distributed/__init__.py": "",
    "vllm/distributed/parallel_state.py": """
        class Group:
            def __init__(self, world_size, rank_in_group):
                self.world_size, self.rank_in_group = world_size, rank_in_group
        _DCP = None
        _PCP = None
        def get_dcp_group():
            assert _DCP is not None, "decode context model parallel group is not initialized"
            return _DCP
        def get_pcp_group():
            return _PCP
        """,
    "vllm/config/__init__.py": """
        from types import SimpleNamespace
        _CFG = SimpleNamespace(parallel_config=SimpleNamespace(cp_kv_cache_interleave_size=1))
        def get_current_vllm_config_or_none():
            return _CFG
        """,
    "vllm/v1/__init__.py": "",
    "vllm/v1/worker/__init__.py": "",
    "vllm/v1/worker/gpu/__init__.py": "",
    "vllm/v1/worker/gpu/model_states/__init__.py": "",
    "vllm/v1/worker/gpu/attn_utils.py": """
        def build_attn_metadata(attn_groups, num_reqs, num_tokens, query_start_loc_gpu, query_start_loc_cpu,
                                max_query_len, seq_lens, max_seq_len, block_tables, slot_mappings, kv_cache_config,
                                seq_lens_cpu_upper_bound=None, {dcp_param}=None, for_cudagraph_capture=False,
                                ubatch_idx=0):
            if num_reqs < 0:
                raise ValueError("the engine's own error")
            {cut}
            view = {dcp_param}
            return {{"num_reqs": num_reqs, "dcp": None if view is None else [int(x) for x in view[:num_reqs]]}}
        """,
    "vllm/v1/worker/gpu/model_states/default.py": """
        from vllm.v1.worker.gpu.attn_utils import build_attn_metadata
        class DefaultModelState:
            def prepare_attn(self, input_batch, cudagraph_mode, block_tables, slot_mappings, attn_groups,
                             kv_cache_config, for_capture=False{ubatch_param}):
                ubatch_idx = 0
                full = getattr(cudagraph_mode, "name", "") == "FULL"
                n = input_batch.num_reqs_after_padding if full else input_batch.num_reqs
                return build_attn_metadata(attn_groups=attn_groups, num_reqs=n, num_tokens=0,
                                           query_start_loc_gpu=None,
                                           query_start_loc_cpu=input_batch.query_start_loc_np[: n + 1],
                                           max_query_len=1, seq_lens=input_batch.seq_lens, max_seq_len=1,
                                           block_tables=block_tables, slot_mappings=slot_mappings,
                                           kv_cache_config=kv_cache_config,
                                           {dcp_param}=input_batch.dcp_local_seq_lens,
                                           for_cudagraph_capture=for_capture, ubatch_idx=ubatch_idx)
        """,
    # micro-batching as 0.30-0.33 (cg_mode) or 0.34 (batch_desc) have it; 0.29 has no such module
    "vllm/v1/worker/gpu/ubatch_utils.py": """
        class UBatchRunner:
            def prepare(self, input_batch, block_tables, slot_mappings, {ubatch_mode}, for_capture=False):
                return None
        def _slice_input_batch(input_batch, ubatch_slice, query_start_loc_buf, seq_lens_buf,
                               dcp_local_seq_lens_buf, dcp_size, dcp_rank, cp_interleave):
            return input_batch
        """,
}
# vLLM's build_attn_metadata (0.29-0.34) cuts both views to [:num_reqs] before using them
CUT = "seq_lens = seq_lens[:num_reqs]\n    if {dcp_param} is not None:\n        {dcp_param} = {dcp_param}[:num_reqs]"

# The driver: a batch of 2 requests padded to 4 (seq_lens [17, 25]); DCP 2, rank 0 -> [9, 13, 0, 0].
DRIVER = """
import json, logging, os, sys
from types import SimpleNamespace
import numpy as np
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
import vllm.distributed.parallel_state as ps
ps._DCP = ps.Group(2, 0)
{before}
class _Finder:  # a finder of the same class name as the plugin's, as virtualenv installs one (`_virtualenv._Finder`)
    def find_spec(self, *a, **k):
        return None
sys.meta_path.append(_Finder())
from dcptool.engine import vllm as plugin
plugin.register()
from vllm.v1.worker.gpu.model_states.default import DefaultModelState
from vllm.v1.worker.gpu import attn_utils

def batch(view=(9, 13, 0, 0), **kw):
    b = SimpleNamespace(num_reqs=2, num_reqs_after_padding=4, num_tokens_after_padding=4,
                        seq_lens=np.array([17, 25, 0, 0], np.int32),
                        dcp_local_seq_lens=None if view is None else np.array(view, np.int32),
                        query_start_loc_np=np.array([0, 1, 2, 2, 2], np.int32))
    b.__dict__.update(kw)
    return b

FULL, NONE = SimpleNamespace(name="FULL"), SimpleNamespace(name="NONE")
ms = DefaultModelState()
def build(b, mode=NONE, **kw):
    return ms.prepare_attn(b, mode, None, None, [], None, **kw)
out = {{"results": [], "errors": []}}
{body}
out["files"] = [str(p) for p in plugin.close()]
out["wrapped"] = bool(getattr(attn_utils.build_attn_metadata, "__wrapped_by_dcptool__", False))
# by identity: other finders share the name (virtualenv's `_virtualenv._Finder` is on many images' meta path)
out["finder"] = any(isinstance(f, plugin._Finder) for f in sys.meta_path)
out["other_finder"] = any(type(f) is _Finder for f in sys.meta_path)
out["used"] = plugin._S.used
print(json.dumps(out))
"""


def run_case(tmp_path, body, *, before="", env=None, version="0.33.0", dcp_param="dcp_local_seq_lens", cut="",
             ubatch_param=", ubatch_idx=0", ubatch_mode="cg_mode"):
    fake = tmp_path / "fake"
    for rel, src in FAKE.items():
        p = fake / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(src).format(version=version, dcp_param=dcp_param, ubatch_param=ubatch_param,
                                                 ubatch_mode=ubatch_mode, cut=cut.format(dcp_param=dcp_param)))
    rec = tmp_path / "rec"
    e = {k: v for k, v in os.environ.items() if not k.startswith("DCPTOOL_")}
    e.update({"PYTHONPATH": f"{fake}{os.pathsep}{ROOT}", "DCPTOOL_RECORD": str(rec), **(env or {})})
    if e["DCPTOOL_RECORD"] == "":
        del e["DCPTOOL_RECORD"]
    script = DRIVER.format(before=textwrap.dedent(before), body=textwrap.dedent(body))
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=e, timeout=120)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.splitlines()[-1])
    out["stderr"] = p.stderr
    out["dump"] = open_dumps(out["files"]) if out["files"] else None
    return out


STEPS = """
with plugin.step():
    out["results"].append(build(batch(), FULL))
    out["results"].append(build(batch(), NONE))
out["results"].append(build(batch(view=None), NONE))
"""


def test_records_each_build_with_its_batch(tmp_path):
    out = run_case(tmp_path, STEPS)
    assert out["wrapped"] and out["finder"]
    assert out["results"] == [{"num_reqs": 4, "dcp": [9, 13, 0, 0]}, {"num_reqs": 2, "dcp": [9, 13]},
                              {"num_reqs": 2, "dcp": None}]  # the engine's results, untouched
    d = out["dump"]
    assert [os.path.basename(f) for f in d.files] == ["rank0.00000.safetensors"]
    assert d.config.dcp_size == 2 and d.config.cp_interleave == 1 and d.config.engine == "vllm"
    assert d["obs.step"].tolist() == [0, 0, 1]  # one step scope, then a build on its own
    assert d["obs.num_reqs"].tolist() == [2, 2, 2] and d["obs.num_reqs_padded"].tolist() == [4, 4, 4]
    assert d["obs.graph"].tolist() == [3, 0, 0]  # FULL at runtime = a full-graph replay
    assert d["obs.has_dcp"].tolist() == [1, 1, 0]
    assert d.dcp_of(0).tolist() == [9, 13, 0, 0] and d.dcp_of(1).tolist() == [9, 13, 0, 0]  # the view as passed
    assert d.qsl_of(0).tolist() == [0, 1, 2, 2, 2] and d["obs.num_tokens_padded"].tolist() == [4, 4, 4]
    assert {d.site_name(i) for i in range(d.n)} == {"attn_metadata"}


def test_nothing_happens_without_the_variable(tmp_path):
    out = run_case(tmp_path, STEPS, env={"DCPTOOL_RECORD": ""})
    assert out["other_finder"]  # the driver's own `_Finder` (as virtualenv's): not taken for the plugin's
    assert not out["wrapped"] and not out["finder"] and out["files"] == []
    assert out["results"][0] == {"num_reqs": 4, "dcp": [9, 13, 0, 0]}
    assert not (tmp_path / "rec").exists()


def test_modules_loaded_before_register_are_patched_and_rebound(tmp_path):
    # default.py imported build_attn_metadata by name before the plugin ran: it must see the wrapper
    out = run_case(tmp_path, STEPS, before="import vllm.v1.worker.gpu.model_states.default\n")
    assert out["wrapped"] and out["dump"].n == 3


def test_unsupported_version_records_nothing_and_warns_once(tmp_path):
    out = run_case(tmp_path, STEPS, version="0.28.0")  # older than every hook table
    assert out["files"] == [] and not out["wrapped"]
    assert out["stderr"].count("dcptool: vLLM recording disabled") == 1 and "0.28.0" in out["stderr"]
    out = run_case(tmp_path, STEPS, version="0.28.0", env={"DCPTOOL_VLLM_UNTESTED": "1"})
    assert out["dump"].n == 3


def test_a_newer_version_is_tried_with_the_newest_table_and_stops_on_a_mismatch(tmp_path):
    out = run_case(tmp_path, STEPS, version="0.40.1")
    assert out["dump"].n == 3 and "disabled" not in out["stderr"]
    assert out["stderr"].count("newer than the releases this plugin knows") == 1
    assert set(out["used"].values()) == {"0.34"}
    out = run_case(tmp_path, STEPS, version="0.40.1", dcp_param="dcp_lengths")
    assert out["files"] == [] and not out["wrapped"]
    assert out["stderr"].count("dcptool: vLLM recording disabled") == 1


UBATCH = """
from vllm.v1.worker.gpu import ubatch_utils
out["ubatch_wrapped"] = bool(getattr(ubatch_utils.UBatchRunner.prepare, "__wrapped_by_dcptool__", False))
with plugin.step():
    out["results"].append(build(batch(), NONE))
"""


def test_each_release_line_gets_its_table(tmp_path):
    # 0.31 and 0.32 have 0.33's hooks (refused by the version check before)
    for version in ("0.31.0", "0.32.1", "0.33.0"):
        out = run_case(tmp_path, UBATCH, version=version)
        assert out["ubatch_wrapped"] and set(out["used"].values()) == {"0.31-0.33"}, version
    # 0.34: UBatchRunner.prepare takes batch_desc instead of cg_mode
    out = run_case(tmp_path, UBATCH, version="0.34.0", ubatch_mode="batch_desc, dp_sync_state=None")
    assert out["ubatch_wrapped"] and set(out["used"].values()) == {"0.34"} and "disabled" not in out["stderr"]
    assert out["dump"].config.engine_version == "0.34.0"
    # a prepare that no table knows: recording stops, once, and the engine runs on
    out = run_case(tmp_path, UBATCH, version="0.34.0", ubatch_mode="execution_mode")
    assert "UBatchRunner.prepare has no parameter batch_desc" in out["stderr"]
    assert not out["ubatch_wrapped"] and out["stderr"].count("dcptool: vLLM recording disabled") == 1
    assert out["files"] == [] and out["results"] == [{"num_reqs": 2, "dcp": [9, 13]}]


def test_0_29_has_no_ubatch_idx_and_no_micro_batches(tmp_path):
    out = run_case(tmp_path, STEPS, version="0.29.0", ubatch_param="")
    assert "disabled" not in out["stderr"] and out["dump"].n == 3
    assert out["used"]["vllm.v1.worker.gpu.model_states.default"] == "0.29"
    c = out["dump"].config
    assert "ubatch" not in c.sites and "dummy" in c.sites
    assert "sites possible: attn_metadata, dummy" in c.note and "not possible: ubatch" in c.note
    # dcptool inspect shows it
    p = cli("inspect", *out["files"])
    assert p.returncode == 0 and "not possible: ubatch" in p.stdout
    # a 0.30+ recording says every site is possible
    assert "not possible" not in run_case(tmp_path, STEPS)["dump"].config.note


def test_a_version_string_that_lies_is_matched_by_signature(tmp_path):
    # a build that calls itself 0.33 but has 0.29's prepare_attn: the 0.29 table fits that module
    out = run_case(tmp_path, STEPS, version="0.33.0", ubatch_param="")
    assert "disabled" not in out["stderr"] and out["dump"].n == 3
    assert out["used"]["vllm.v1.worker.gpu.model_states.default"] == "0.29"


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


def test_other_internals_record_nothing_and_warn_once(tmp_path):
    out = run_case(tmp_path, STEPS, dcp_param="dcp_lengths")  # a renamed parameter
    assert out["files"] == [] and not out["wrapped"]
    assert out["stderr"].count("dcptool: vLLM recording disabled") == 1
    assert "build_attn_metadata has no parameter dcp_local_seq_lens" in out["stderr"]
    assert out["results"] == run_case(tmp_path, STEPS)["results"]  # the engine sees exactly what it would


def test_a_failure_while_recording_never_reaches_the_engine(tmp_path):
    body = """
    b = batch()
    del b.num_tokens_after_padding  # a batch without a field only the recorder reads
    out["results"].append(build(b, NONE))
    out["results"].append(build(batch(), NONE))  # recording has stopped; the engine goes on
    """
    out = run_case(tmp_path, body)
    assert out["results"] == [{"num_reqs": 2, "dcp": [9, 13]}] * 2
    assert out["stderr"].count("dcptool: vLLM recording disabled") == 1 and "AttributeError" in out["stderr"]
    assert out["files"] == []


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


def test_rolls_files_and_names_them_by_rank(tmp_path):
    body = """
    ps._DCP = ps.Group(2, 1)
    for _ in range(5):
        build(batch(view=(8, 12, 0, 0)), NONE)
    """
    out = run_case(tmp_path, body, env={"DCPTOOL_ROLLOVER": "2"})
    assert [os.path.basename(f) for f in out["files"]] == [f"rank1.0000{i}.safetensors" for i in range(3)]
    d = out["dump"]
    assert d.n == 5 and d["obs.rank"].tolist() == [1] * 5 and d["obs.step"].tolist() == list(range(5))


def test_builds_inside_graph_capture_are_skipped_not_copied(tmp_path):
    before = """
    import types
    torch = types.ModuleType("torch")
    torch.cuda = types.SimpleNamespace(is_available=lambda: True, is_current_stream_capturing=lambda: True)
    sys.modules["torch"] = torch
    """
    out = run_case(tmp_path, STEPS, before=before)
    assert out["files"] == [] and out["results"][0] == {"num_reqs": 4, "dcp": [9, 13, 0, 0]}
    assert "disabled" not in out["stderr"]


def test_without_a_dcp_group_it_records_dcp_size_1(tmp_path):
    body = """
    ps._DCP = None
    build(batch(view=None), NONE)
    """
    out = run_case(tmp_path, body)
    d = out["dump"]
    assert d.config.dcp_size == 1 and d["obs.has_dcp"].tolist() == [0]


def test_recorded_dump_replays_clean(tmp_path):
    n = 3
    body = f"""
    for _ in range({n}):
        with plugin.step():
            build(batch(), FULL)
    """
    out = run_case(tmp_path, body)
    p = cli("replay", "--backend", "torch", *out["files"], "--json")
    summary = json.loads(p.stdout.splitlines()[-1])
    assert p.returncode == 0 and summary["observations"] == n and summary["findings"] == 0
    assert np.array_equal(out["dump"]["obs.step"], np.arange(n))


def test_tables_for_each_version():
    from dcptool.engine.vllm import TABLES, tables_for

    first = {v: [t.line for t in tables_for(v)][:1] for v in
             ("0.29.0", "0.29.3", "0.30.0", "0.31.1", "0.32.0", "0.33.0", "0.34.0", "0.34.2rc1", "0.35.0", "1.2.0",
              "0.28.0", "0.27.1", "dev", "")}
    assert first == {"0.29.0": ["0.29"], "0.29.3": ["0.29"], "0.30.0": ["0.30"], "0.31.1": ["0.31-0.33"],
                     "0.32.0": ["0.31-0.33"], "0.33.0": ["0.31-0.33"], "0.34.0": ["0.34"], "0.34.2rc1": ["0.34"],
                     "0.35.0": ["0.34"], "1.2.0": ["0.34"], "0.28.0": [], "0.27.1": [], "dev": [], "": []}
    assert [t.line for t in tables_for("0.35.0")] == ["0.34"]  # a newer release: the newest table only
    assert len(tables_for("0.33.0")) == len(TABLES)  # a known release: its own, then the others by signature
    assert [t.line for t in tables_for("0.28.0", untested=True)] == ["0.34", "0.31-0.33", "0.30", "0.29"]
    assert {"ubatch"} == set(TABLES[1].sites) - set(TABLES[0].sites)  # 0.29 cannot produce micro-batches
