"""The vLLM plugin's builder hooks (builders) against a fake vLLM: the columns FlashInfer's and MLA's metadata
builders hand attention go with their build's observation; the recording's page size; what is not recorded, and a
builder the hooks cannot read. What vLLM's real builders hand is tested in tests/vllm (test_vllm_builders.py)."""

import json
import textwrap

from conftest import cli
from vllm_cases import BACKENDS, CUT, run_case

FI = """
from vllm.v1.attention.backends.flashinfer import FlashInferMetadataBuilder
from vllm.model_executor.layers.attention.mla_attention import MLACommonMetadataBuilder
"""


def with_builders(body: str) -> str:
    return FI + textwrap.dedent(body)


def columns(d, i):
    """Observation i's builder columns (None: not recorded in the dump)."""
    def part(off, rows):
        return d[rows][d[off][i]:d[off][i + 1]].tolist() if d.has(off) else None

    kv = d["rows.kv_pages"][d["obs.rows"][i]:d["obs.rows"][i + 1]].tolist() if d.has("rows.kv_pages") else None
    return {"dqsl": part("obs.dqsl", "rows.dcp_query_start_loc"), "tot": part("obs.tot", "rows.dcp_tot_seq_lens"),
            "kv": kv, "ctx": part("obs.ctx", "rows.ctx_chunks")}


def test_flashinfer_and_mla_columns_go_with_their_build(tmp_path):
    body = with_builders("""
    with plugin.step():
        out["results"].append(build(batch(), NONE, groups=[FlashInferMetadataBuilder(), MLACommonMetadataBuilder()]))
    """)
    out = run_case(tmp_path, body, cut=CUT)
    d = out["dump"]
    assert out["results"] == [{"num_reqs": 2, "dcp": [9, 13]}] and "disabled" not in out["stderr"]
    assert set(out["used"].values()) == {"0.31-0.33"}
    # two decodes: Q = query_start_loc[:3]; the plan's pages cdiv([9, 13], 16); MLA's companion: the global lengths
    assert d.n == 1 and columns(d, 0) == {"dqsl": [0, 1, 2], "tot": [17, 25], "kv": [1, 1], "ctx": [0]}
    assert d.config.page_size == 16 and "builders: dcp_query_start_loc" in d.config.note
    p = cli("replay", "--backend", "torch", *out["files"], "--json")
    assert p.returncode == 0 and json.loads(p.stdout.splitlines()[-1])["findings"] == 0, p.stdout


def test_kv_pages_are_one_per_recorded_row_and_unknown_on_dcp_prefill_rows(tmp_path):
    body = with_builders("""
    b = batch(query_start_loc_np=np.array([0, 1, 9, 9, 9], np.int32))  # a decode, then a prefill of 8 tokens
    build(b, NONE, groups=[FlashInferMetadataBuilder(trtllm=False)])
    build(b, NONE, groups=[FlashInferMetadataBuilder(dcp_world_size=1, trtllm=False)])  # a replicated cache
    """)
    d = run_case(tmp_path, body)["dump"]  # no [:num_reqs] cut: the observation holds all 4 rows of seq_lens
    assert columns(d, 0) == {"dqsl": None, "tot": None, "kv": [1, -1, -1, -1], "ctx": None}
    assert columns(d, 1)["kv"] == [1, 1, -1, -1]  # without DCP a prefill row's plan is checked like any other


def test_mla_chunked_context_goes_with_its_build(tmp_path):
    """MLA's prefill of a request with context: the chunks its metadata hands attention, at the request's row after
    the decodes, with the max_context_chunk its plan was given; a pure-decode build records [0] (no gather)."""
    body = with_builders("""
    b = batch(query_start_loc_np=np.array([0, 1, 9, 9, 9], np.int32))  # a decode, then 8 tokens on 17 of context
    build(b, NONE, groups=[MLACommonMetadataBuilder()])
    build(batch(), NONE, groups=[MLACommonMetadataBuilder()])
    """)
    d = run_case(tmp_path, body, cut=CUT)["dump"]
    assert [columns(d, i)["ctx"] for i in range(2)] == [[8192, 0, 1, 0, 17], [0]]


def test_the_page_size_is_the_first_plans_even_after_the_recorder_exists(tmp_path):
    body = with_builders("""
    build(batch(), NONE)  # no builder: the Recorder starts without a page size
    build(batch(), NONE, groups=[FlashInferMetadataBuilder(page_size=16)])
    build(batch(), NONE, groups=[FlashInferMetadataBuilder(page_size=32)])  # another page size: not recorded
    out["skipped"] = dict(plugin.STATE.skipped)
    """)
    out = run_case(tmp_path, body, cut=CUT)
    d = out["dump"]
    assert d.n == 3 and d.config.page_size == 16
    assert [columns(d, i)["kv"] for i in range(3)] == [[-1, -1], [1, 1], [-1, -1]]
    assert out["skipped"] == {"page counts of another page size than the recording's": 1}


def test_builders_outside_build_attn_metadata_record_nothing(tmp_path):
    body = with_builders("""
    from collections import namedtuple
    from vllm.v1.worker.gpu.attn_utils import CommonAttentionMetadata
    cm = CommonAttentionMetadata(2, np.array([0, 1, 2]), np.array([17, 25]), np.array([9, 13]))
    out["results"].append(FlashInferMetadataBuilder().build(0, cm).num_decodes)
    out["results"].append(len(MLACommonMetadataBuilder().build(0, cm).decode.dcp_tot_seq_lens))
    """)
    out = run_case(tmp_path, body)
    assert out["results"] == [2, 2] and out["files"] == [] and "disabled" not in out["stderr"]


def test_a_builder_result_the_hook_cannot_read_stops_recording_not_the_engine(tmp_path):
    odd = BACKENDS["vllm/v1/attention/backends/flashinfer.py"].replace(
        "return SimpleNamespace(num_decodes=nd, decode=decode)", "return SimpleNamespace(decode=decode)")
    body = with_builders("""
    out["results"].append(build(batch(), NONE, groups=[FlashInferMetadataBuilder()]))
    out["results"].append(build(batch(), NONE, groups=[FlashInferMetadataBuilder()]))
    """)
    out = run_case(tmp_path, body, backends={"vllm/v1/attention/backends/flashinfer.py": odd})
    assert out["results"] == [{"num_reqs": 2, "dcp": [9, 13]}] * 2 and out["files"] == []
    assert out["stderr"].count("dcptool: vLLM recording disabled") == 1 and "num_decodes" in out["stderr"]


def test_a_builder_without_the_hooked_signature_disables_recording_once(tmp_path):
    renamed = BACKENDS["vllm/v1/attention/backends/flashinfer.py"].replace("num_blocks_np", "pages_np")
    out = run_case(tmp_path, with_builders("build(batch(), NONE, groups=[FlashInferMetadataBuilder()])\n"),
                   backends={"vllm/v1/attention/backends/flashinfer.py": renamed})
    assert out["stderr"].count("dcptool: vLLM recording disabled") == 1
    assert "FlashInferMetadataBuilder._compute_flashinfer_kv_metadata has no parameter num_blocks_np" in out["stderr"]
