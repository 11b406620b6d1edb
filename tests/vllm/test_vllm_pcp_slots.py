"""simulate's slot columns under PCP against vLLM's own PCP slot mapping. vLLM computes the global
batch's slot mapping (BlockTables.compute_slot_mappings, its Triton kernel in the interpreter) with DCP-only ownership
(cp_size = dcp_size) and hands attention the PCP-gathered form (PCPManager._convert_to_gathered_slot_mappings after
partition_batch): every PCP rank's local tokens, a replicated request written once, from PCP rank 0's copy. Each PCP
rank's tokens of it are what simulate records (its replicated tokens with the slot rank 0's copy writes), token for
token on the same block layout; recorded per (PCP rank, DCP rank), they replay clean with the slot rules active."""

import engine as E
import numpy as np
import pytest
import torch

from dcptool.check.replay import replay
from dcptool.dcp.reference import local_of
from dcptool.dcp.slicing import pcp_partition, pcp_rank_tokens
from dcptool.dump import open_dumps
from dcptool.engine.recorder.record import Recorder
from dcptool.model.columns import Columns
from dcptool.model.config import KV_GROUPS, SimConfig
from dcptool.model.rows import make_rows

pytestmark = pytest.mark.vllm

B, MAX_MODEL_LEN = 16, 512
PER_REQ = -(-MAX_MODEL_LEN // B) + 1  # simulate's layout: request k owns blocks k * PER_REQ + j
# 0.30+ replicate a prefill too short to fill 2P chunks under DCP (replicated_requests); 0.29 replicates decodes only,
# and dcptool's partition follows 0.30+, so 0.29 gets no such prefill. Decodes first, as vLLM orders a batch (0.29
# orders local rows otherwise: pure prefills last, which this batch's order already is)
SHORT = hasattr(E.PCPManager, "replicated_requests")
Q, SEQ = ([1, 1, 9, 23, 40], [300, 77, 29, 123, 40]) if SHORT else ([1, 1, 23, 40], [300, 77, 123, 40])
FLAGS = [dcp for _, dcp in KV_GROUPS]
# the groups this release's kernel shards as simulate does (0.29-0.30 localise every group: slot-wrong-group)
SAME = [g for g, (a, b) in enumerate(zip(E.vllm_groups(FLAGS), FLAGS)) if a == b]


def vllm_pcp(P: int, N: int, r: int, I_: int, T: int):
    """DCP rank r's view of vLLM's PCP step: per PCP rank, its real local tokens' (global request, position) and its
    segment [groups, tokens] of the gathered slot mapping (what attention writes); and the gathered slot mapping
    [groups, P * T], its positions and write mask. `T`: the runner's dispatch size, the largest PCP rank's tokens
    (0.29-0.30 take it as the padded token count)."""
    bt = E.slot_tables([B] * len(FLAGS), FLAGS, N, r, I_, max_num_tokens=256)
    for t in bt.block_tables:  # simulate's block layout instead of a random one
        t.gpu.copy_(torch.arange(t.gpu.shape[0])[:, None] * PER_REQ + torch.arange(t.gpu.shape[1]))
    b = E.prepare_inputs(Q, SEQ, E.buffers(8, 256))
    glob = bt.compute_slot_mappings(torch.arange(len(Q), dtype=torch.int32), b.query_start_loc, b.positions, sum(Q))
    mgrs = [E.pcp_manager(P, p, 8, 256, N, r, I_) for p in range(P)]
    locs = [E.partition(m, b, "none", T) for m in mgrs]
    gathered = mgrs[0]._convert_to_gathered_slot_mappings(glob.clone()).numpy()
    assert gathered.shape[1] == P * T and all(lb.num_tokens_after_padding == T for lb in locs)
    ranks = []
    for p, lb in enumerate(locs):
        n = int(lb.num_tokens)
        req = np.repeat(lb.idx_mapping_np[: lb.num_reqs], lb.num_scheduled_tokens[: lb.num_reqs])
        seg = gathered[:, p * T : (p + 1) * T]
        assert (seg[:, n:] == -1).all()  # padded tokens write nothing
        ranks.append((req, lb.positions[:n].numpy(), seg[:, :n]))
    gathered_pos = np.concatenate([lb.positions[:T].numpy() for lb in locs])
    return ranks, gathered, gathered_pos, mgrs[0]._gathered_kv_write_mask.numpy()


def by_token(req, pos, *cols):
    """Columns ordered by (request, position): vLLM's local row order differs by release (0.29: pure prefills last)."""
    o = np.lexsort((pos, req))
    return [req[o], pos[o]] + [c[..., o] for c in cols]


@pytest.mark.parametrize("P,N,I_", [(2, 2, 1), (2, 4, 4), (3, 2, 16)], ids=lambda v: str(v))
def test_simulate_pcp_slots_are_vllms_gathered_slot_mapping_and_replay_clean(P, N, I_, tmp_path):
    q, seq = np.array(Q), np.array(SEQ)
    comp, isp = seq - q, q > 1
    cols = Columns(SimConfig(dcp=N, interleave=I_, pcp=P, page_size=B, max_model_len=MAX_MODEL_LEN), frozenset())
    T = int(pcp_rank_tokens(q, isp, P, N).max())
    sim = []
    for p in range(P):
        lb = pcp_partition(q, comp, isp, P, p, N)
        rows = make_rows(lb.query_lens, lb.seq_lens, lb.num_reqs, T, lb.req)
        pos, out = cols.slots(rows, "final", "step", 0, [])
        assert (pos[lb.num_tokens :] == 0).all() and (out[:, :, lb.num_tokens :] == -1).all()
        sim.append((rows, np.repeat(lb.req, lb.query_lens), pos, out))
    kv = [{"name": n, "dcp": dcp, "block_size": B} for n, dcp in KV_GROUPS]
    path = tmp_path / "pcp.safetensors"
    refilled = 0
    with Recorder(path, dcp_size=N, cp_interleave=I_, pcp_size=P, page_size=B, kv_groups=kv) as rec:
        for r in range(N):
            E.set_dcp(N, r)
            ranks, gathered, gathered_pos, kept = vllm_pcp(P, N, r, I_, T)
            first = by_token(*ranks[0])  # PCP rank 0 writes every replicated request (vLLM's canonical copy)
            for p, (rows, req, pos, out) in enumerate(sim):
                n = req.size
                vreq, vpos, seg = by_token(*ranks[p])
                sreq, spos, got = by_token(req, pos[:n], out[r][:, :n])
                assert np.array_equal(sreq, vreq) and np.array_equal(spos, vpos)  # the same local tokens
                # where they differ: a replicated request's token on a PCP rank > 0 (vLLM masks it there), and
                # simulate records the slot PCP rank 0's copy of that token writes
                differ = np.flatnonzero((got[SAME] != seg[SAME]).any(axis=0))
                assert p > 0 or differ.size == 0
                assert (seg[SAME][:, differ] == -1).all()
                at = np.searchsorted(first[0] * MAX_MODEL_LEN + first[1], vreq[differ] * MAX_MODEL_LEN + vpos[differ])
                assert np.array_equal(first[0][at], vreq[differ]) and np.array_equal(first[1][at], vpos[differ])
                assert np.array_equal(got[SAME][:, differ], first[2][SAME][:, at])
                refilled += differ.size
                rec.observe(step=0, site="pcp_partition", rank=r, seq_lens=rows.seq, num_reqs=rows.nr,
                            num_reqs_padded=rows.nrp, dcp_local_seq_lens=local_of(rows.seq, r, N, I_),
                            query_start_loc=rows.qsl, num_tokens_padded=T, positions=pos,
                            slot_mapping={g: out[r][g] for g in range(len(KV_GROUPS))})
            # ownership over DCP only (not pcp_size * dcp_size): of the tokens vLLM's write mask keeps (each token of
            # the global batch once), rank r writes the positions (p // I) % N == r of a sharded group, all of a
            # replicated one
            assert kept.sum() == q.sum()
            mine = kept & ((gathered_pos // I_) % N == r)
            for g, sharded in enumerate(E.vllm_groups(FLAGS)):
                assert np.array_equal(gathered[g] >= 0, mine if sharded else kept)
    assert refilled > 0  # the decodes (and short prefills) every PCP rank holds
    d = open_dumps([path])
    res = replay(d, "torch")
    assert res.findings == [] and not {"slots", "slot-partition"} & set(res.skipped)
    assert (d["rows.slot_mapping"] >= 0).sum() > 0
