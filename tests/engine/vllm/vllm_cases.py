"""A fake vLLM for the plugin's tests (no vLLM needed): each case runs in a fresh interpreter, as vLLM's worker
processes do, with a small fake `vllm` package on the path that has model runner V2's hooked functions with their
real signatures. What the plugin records from vLLM's real code is tested in tests/vllm (make test-vllm).
"""

import json
import os
import subprocess
import sys
import textwrap

from conftest import ROOT

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
        from collections import namedtuple
        CommonAttentionMetadata = namedtuple("CommonAttentionMetadata",
                                             "num_reqs query_start_loc_cpu seq_lens dcp_local_seq_lens")
        def build_attn_metadata(attn_groups, num_reqs, num_tokens, query_start_loc_gpu, query_start_loc_cpu,
                                max_query_len, seq_lens, max_seq_len, block_tables, slot_mappings, kv_cache_config,
                                seq_lens_cpu_upper_bound=None, {dcp_param}=None, for_cudagraph_capture=False,
                                ubatch_idx=0):
            if num_reqs < 0:
                raise ValueError("the engine's own error")
            {cut}
            view = {dcp_param}
            for group in attn_groups:  # each attention group's metadata builder, as vLLM's does
                for builder in group:
                    builder.build(0, CommonAttentionMetadata(num_reqs, query_start_loc_cpu, seq_lens, view))
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
# The attention backends' metadata builders (written as they are: no format fields), with the hooked methods' real
# signatures and what they hand attention: FlashInfer's decode metadata (dcp_query_start_loc, 0.30+) and the page
# counts of its plan (computed from the local lengths, as 0.30+ do; a prefill row plans its context), MLA's decode
# metadata (dcp_tot_seq_lens = the global lengths of the decodes) and its prefills' chunked context (one chunk a
# request, planned with max_context_chunk 8192). Decodes come first (query length <= 1).
BACKENDS = {
    "vllm/v1/attention/__init__.py": "",
    "vllm/v1/attention/backends/__init__.py": "",
    "vllm/v1/attention/backends/flashinfer.py": """
        from types import SimpleNamespace
        import numpy as np
        class FlashInferMetadataBuilder:
            def __init__(self, page_size=16, dcp_world_size=2, trtllm=True):
                self.page_size, self.dcp_world_size, self.trtllm = page_size, dcp_world_size, trtllm
            def _compute_flashinfer_kv_metadata(self, num_blocks_np, seq_lens_np, block_table_tensor, num_reqs,
                                                page_size):
                self.paged_kv_indptr = np.concatenate([[0], np.cumsum(num_blocks_np)])
            def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
                cm = common_attn_metadata
                n = cm.num_reqs
                qsl = np.asarray(cm.query_start_loc_cpu)[: n + 1]
                q = np.diff(qsl)
                nd = int((q <= 1).sum())
                local = np.asarray(cm.dcp_local_seq_lens)[:n].copy()
                local[nd:] -= q[nd:]  # (a prefill row's local context, near enough for a fake)
                self._compute_flashinfer_kv_metadata((local + self.page_size - 1) // self.page_size, local, None, n,
                                                     self.page_size)
                decode = SimpleNamespace(dcp_query_start_loc=qsl[: nd + 1]) if nd and self.trtllm else None
                return SimpleNamespace(num_decodes=nd, decode=decode)
        """,
    "vllm/model_executor/__init__.py": "",
    "vllm/model_executor/layers/__init__.py": "",
    "vllm/model_executor/layers/attention/__init__.py": "",
    "vllm/model_executor/layers/attention/mla_attention.py": """
        from types import SimpleNamespace
        import numpy as np
        def plan_mla_context_chunks(context_lens, row_budget, max_context_chunk, split_alignment, padded_rows):
            return [(i, n) for i, n in enumerate(context_lens) if n > 0]  # (one chunk a request, for a fake)
        class MLACommonMetadataBuilder:
            def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
                cm = common_attn_metadata
                q = np.diff(np.asarray(cm.query_start_loc_cpu)[: cm.num_reqs + 1])
                nd = int((q <= 1).sum())
                ctx = (np.asarray(cm.seq_lens)[nd:cm.num_reqs] - q[nd:]).tolist()
                cc = None
                if max(ctx, default=0) > 0:
                    chunks = [SimpleNamespace(request_slice=slice(i, i + 1), seq_lens=np.array([n]))
                              for i, n in plan_mla_context_chunks(ctx, 4096, 8192, 16, None)]
                    cc = SimpleNamespace(chunks=chunks)
                return SimpleNamespace(num_decodes=nd, prefill=SimpleNamespace(chunked_context=cc),
                                       decode=SimpleNamespace(dcp_tot_seq_lens=np.asarray(cm.seq_lens)[:nd]))
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
class Finder:  # a finder of the same class name as the plugin's, as virtualenv installs one (`_virtualenv._Finder`)
    def find_spec(self, *a, **k):
        return None
sys.meta_path.append(Finder())
from dcptool.engine import vllm as plugin
from dcptool.engine.vllm import tables
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
def build(b, mode=NONE, groups=(), **kw):
    return ms.prepare_attn(b, mode, None, None, [list(groups)], None, **kw)
out = {{"results": [], "errors": []}}
{body}
out["files"] = [str(p) for p in plugin.close()]
out["wrapped"] = bool(getattr(attn_utils.build_attn_metadata, "__wrapped_by_dcptool__", False))
# by identity: other finders share the name (virtualenv's `_virtualenv._Finder` is on many images' meta path)
out["finder"] = any(isinstance(f, tables.Finder) for f in sys.meta_path)
out["other_finder"] = any(type(f) is Finder for f in sys.meta_path)
out["used"] = plugin.STATE.used
print(json.dumps(out))
"""


def run_case(tmp_path, body, *, before="", env=None, version="0.33.0", dcp_param="dcp_local_seq_lens", cut="",
             ubatch_param=", ubatch_idx=0", ubatch_mode="cg_mode", backends=None):
    """Run `body` in a fresh interpreter against the fake vLLM; `backends`: builder modules to use instead of BACKENDS'
    (path -> source)."""
    fake = tmp_path / "fake"
    fields = dict(version=version, dcp_param=dcp_param, ubatch_param=ubatch_param, ubatch_mode=ubatch_mode,
                  cut=cut.format(dcp_param=dcp_param))
    files = {**{k: textwrap.dedent(v).format(**fields) for k, v in FAKE.items()},
             **{k: textwrap.dedent(v) for k, v in {**BACKENDS, **(backends or {})}.items()}}
    for rel, src in files.items():
        p = fake / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(src)
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
