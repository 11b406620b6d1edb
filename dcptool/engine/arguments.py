"""observe()'s arguments on the host: private int32 copies, Python ints, and the checks of what a dump cannot hold."""

from __future__ import annotations

import operator
import re
import sys

import numpy as np

from dcptool.dump import INT32_MAX, Record, Scalars, slot_entries
from dcptool.dump.observation import ROWS, ROWS_PLUS_1, Field
from dcptool.dump.schema import GraphMode, text_ok

I64_MAX = 2**63 - 1
I64_MIN = -(2**63)
_NEW = tuple.__new__  # a Record or Scalars without its Python-level __new__ (the per-observation path)
NO_SLOTS = (None, None, None)  # observe() without slot entries
# Unicode category Cc exactly (C0 controls, DEL, C1 controls): a site name is shown in warnings, logs and reports,
# where a newline or an escape sequence would forge a line or drive the terminal
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")
_SITES_KEPT = 1024  # site names remembered as checked (the fast path takes only those)


_INT32 = np.dtype(np.int32)  # (numpy's native int32 dtype is one object: `is` is the cheapest comparison)


def int32_copy(a: np.ndarray) -> np.ndarray:
    """A private int32 copy; values int32 cannot hold raise (the observation is dropped), never wrap."""
    if a.dtype is _INT32:
        return a.copy()
    if a.dtype.kind not in "iub":
        raise ValueError(f"integer values expected, got dtype {a.dtype}")
    b = a.astype(np.int32)
    if a.dtype.itemsize >= 4 and not np.array_equal(b, a):  # one pass; only wider types can wrap
        raise ValueError(f"values must fit int32, got [{int(a.min())}, {int(a.max())}]")
    return b


def host_copy(x) -> np.ndarray | None:
    """A private host copy of a tensor / array / list (never a view of engine memory)."""
    if x is None:
        return None
    if hasattr(x, "detach"):  # torch.Tensor, on any device: .cpu() syncs on that device's stream
        x = x.detach().to("cpu").numpy()
    a = np.asarray(x)
    return int32_copy(a if a.ndim == 1 else a.reshape(-1))


def host_fast(x) -> np.ndarray | None:
    """host_copy for the common case (None or a numpy array), without the attribute probing."""
    if x is None:
        return None
    if type(x) is np.ndarray and x.ndim == 1:
        return int32_copy(x)
    return host_copy(x)


def per_rank(x, k: int) -> np.ndarray | None:
    """observe_many's per-rank rows (kv_pages, dcp_query_start_loc, dcp_tot_seq_lens): one shared row (a read-only
    view of the private copy for every rank) or [ranks, rows]."""
    if x is None:
        return None
    flat = host_copy(x)
    one = (x.ndim if hasattr(x, "ndim") else np.ndim(x)) == 1
    return np.broadcast_to(flat, (k, flat.size)) if one else flat.reshape(k, -1)


def nonneg(a: np.ndarray | None, name: str) -> np.ndarray | None:
    if a is not None and a.size and a.min() < 0:
        raise ValueError(f"negative {name}")
    return a


def integer(v, name: str) -> int:
    """An integer scalar as a Python int. 1.9, "7", 2.0, True and float arrays raise (the observation is
    dropped and counted): a wrong type is a bug in the caller, and coercing it would record a made-up value.
    numpy integer scalars and 0-d integer host tensors are integers."""
    if type(v) is int:
        return v
    if isinstance(v, (bool, np.bool_)):
        raise ValueError(f"{name} must be an integer, got the bool {v!r}")
    if hasattr(v, "detach") and (v.ndim or v.is_cuda or not _torch_int(v.dtype)):
        raise ValueError(f"{name} must be an integer, got a tensor ({v.dtype}, {tuple(v.shape)}, {v.device})")
    try:
        return operator.index(v)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {type(v).__name__} {v!r}") from None


def optional_integer(v, name: str) -> int | None:
    return None if v is None else integer(v, name)


def _torch_int(dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex) and str(dtype) != "torch.bool"


class NoTensor:
    pass


def tensor_type() -> type:
    """torch.Tensor once torch is imported, else NoTensor (the engine package does not import torch itself)."""
    torch = sys.modules.get("torch")
    return NoTensor if torch is None else torch.Tensor


class LazyTorch:
    """torch, looked up on first use (the engine package does not import it: a CPU-only engine may not have it)."""

    def __getattr__(self, name):
        import torch

        for k in ("int32", "int64", "cuda", "_C"):
            setattr(self, k, getattr(torch, k))
        return getattr(torch, name)


TORCH = LazyTorch()


def narrowed(x):
    """A device tensor as a contiguous 1-D int32/int64 one (a copy on the stream when it is not): (tensor, wide)."""
    x = x.reshape(-1)
    dt = x.dtype
    if dt is TORCH.int64:
        wide = 1
    elif dt is TORCH.int32:
        wide = 0
    elif not _torch_int(dt):
        raise ValueError(f"integer values expected, got dtype {dt}")
    else:
        x, wide = x.to(TORCH.int32), 0  # a narrower integer type: no value can be lost
    return (x if x.is_contiguous() else x.contiguous()), wide


def buffer_id(t) -> int:
    """Identity of the storage a tensor view aliases (0 when unknown): its storage's base address (one call, cheaper
    than `data_ptr() - storage_offset() * element_size()`)."""
    try:
        return int(t.untyped_storage().data_ptr())
    except Exception:
        return 0


# ---- the checks: what the dump format cannot hold (docs/format.md) raises here, so a write never fails on it ------


def scalars(r: Record) -> Scalars:
    """The record's integers (dump.FIELDS) as Python ints (checked: never coerced); parent None when unknown."""
    step, _, rank, nr, nrp, _, _, ubatch, parent, rs, ts, te, _, ntp, buf, graph, *_ = r
    if (type(step) is int and type(rank) is int and type(ubatch) is int and type(nr) is int and type(nrp) is int
            and (parent is None or type(parent) is int) and (rs is None or type(rs) is int)
            and (ts is None or type(ts) is int) and (te is None or type(te) is int)
            and (ntp is None or type(ntp) is int) and (buf is None or type(buf) is int)
            and (graph is None or type(graph) is int)):
        # what engines pass: no conversion needed
        return _NEW(Scalars, (step, rank, nr, nrp, ubatch, None if parent is None or parent < 0 else parent, rs, ts,
                              te, ntp, buf, graph))
    p, opt = optional_integer(parent, "parent"), optional_integer
    g = int(GraphMode.parse(graph)) if isinstance(graph, str) else opt(graph, "graph")
    return Scalars(integer(step, "step"), integer(rank, "rank"), integer(nr, "num_reqs"),
                   integer(nrp, "num_reqs_padded"), integer(ubatch, "ubatch"), None if p is None or p < 0 else p,
                   opt(rs, "req_start"), opt(ts, "tok_start"), opt(te, "tok_stop"), opt(ntp, "num_tokens_padded"),
                   opt(buf, "buffer"), g)


def check_shared(vals: Scalars, site, site_ok: set, kv_rows: int | None, rows: int, page_size: int | None) -> None:
    """The values one batch's observations share (the rest: check_own)."""
    check_vals(vals, site, site_ok)
    if kv_rows is not None and (page_size is None or kv_rows != rows):
        raise ValueError(f"kv_pages needs page_size in the config and one value per seq_lens row ({rows})")


def check_vals(vals: Scalars, site, site_ok: set) -> None:
    """The scalars and the site of check_shared; a site name that passes joins site_ok (the names checked)."""
    step, _, _, nrp, ubatch, _, rs, ts, te, ntp, _, graph = vals  # Scalars, in order (one unpack: the hot path)
    # any name a reader accepts (reports show markup literally) but lone surrogates and control characters
    if type(site) is not str or site not in site_ok:
        if type(site) is not str or not text_ok(site):
            raise ValueError(f"site must be a string of valid Unicode, got {site!r}")
        if _CONTROL.search(site):
            raise ValueError(f"site {site!r} holds a control character: a site name is text without control "
                             "characters (Unicode category Cc: no newline, tab or escape)")
        if len(site_ok) < _SITES_KEPT:
            site_ok.add(site)
    if not (-I64_MAX - 1 <= step <= I64_MAX and -1 <= ubatch <= INT32_MAX and nrp <= INT32_MAX):
        raise ValueError(f"step {step}, ubatch {ubatch} or num_reqs_padded {nrp} out of range")
    if rs is not None or ts is not None or te is not None or ntp is not None:
        for v in (rs, ts, te, ntp):
            if v is not None and not -1 <= v <= INT32_MAX:
                raise ValueError(f"req_start/tok_start/tok_stop/num_tokens_padded {v} out of range")
    if graph is not None and not 0 <= graph <= 3:
        raise ValueError(f"graph {graph} is not 0..3")


def check_own(rank: int, parent: int | None, buffer: int | None, index: int, dcp_size: int) -> None:
    """... and the values of one rank's observation (index: the one it will get)."""
    if not 0 <= rank < dcp_size:
        raise ValueError(f"rank {rank} out of range for dcp_size {dcp_size}")
    if parent is not None and parent >= index:
        raise ValueError(f"parent {parent} is not an earlier observation")
    if buffer is not None and not -I64_MAX - 1 <= buffer <= I64_MAX:
        raise ValueError(f"buffer {buffer} does not fit int64")


def batch_rows(seq_lens, nr: int, nrp: int, query_start_loc):
    """Host copies and checks shared by observe() and observe_many(); raises on what cannot be stored."""
    seq = host_fast(seq_lens)
    if not 0 <= nr <= nrp or seq.size < nr or (seq.size and seq.min() < 0):
        raise ValueError(f"num_reqs {nr}, num_reqs_padded {nrp}, {seq.size} seq_lens rows")
    qsl = host_fast(query_start_loc)
    if qsl is not None and qsl.size != seq.size + 1:
        qsl = None  # a query_start_loc that does not cover the rows is of no use to replay
    return seq, qsl


def host_slots(positions, slot_mapping, groups: int | None) -> tuple:
    """dump.slot_entries of host copies (int32-checked), for a config of `groups` KV-cache groups (None: not
    named yet); raises on what cannot be stored (dropped)."""
    if positions is None or slot_mapping is None:
        raise ValueError("positions and slot_mapping go together")
    pos = host_copy(positions)
    if pos.size and pos.min() < 0:
        raise ValueError("negative positions")
    if isinstance(slot_mapping, dict):
        maps = {integer(g, "KV-cache group"): host_copy(m) for g, m in slot_mapping.items()}
    else:
        ndim = slot_mapping.ndim if hasattr(slot_mapping, "ndim") else np.ndim(slot_mapping)
        maps = host_copy(slot_mapping) if ndim == 1 else dict(enumerate(host_copy(x) for x in slot_mapping))
    out = slot_entries(pos, maps, groups)
    return out[0], out[1], out[2].astype(np.int32)


class Groups(tuple):
    """The KV-cache groups (ascending) of slot sections snapshotted raw: the ring slot holds the positions once and
    the slot mapping rows back to back; the harvest tiles the positions per group (ring.slot_rows)."""

    __slots__ = ()


def device_slots(positions, slot_mapping, kv_groups, tensor: type, on: str, seen) -> tuple | None:
    """positions and slot_mapping as device sections (positions, the slot mapping rows in group order, Groups):
    the lengths and the groups checked on the host from the shapes (no synchronisation), the values by the
    kernel (negative positions, int32) at harvest. None when any of them is not a tensor of the device path
    (the host path copies them). Raises what cannot be stored, as host_slots does; seen(groups): the groups
    recorded (kv_groups: the config's, None when not named yet)."""
    if positions is None or slot_mapping is None:
        raise ValueError("positions and slot_mapping go together")
    if not (isinstance(positions, tensor) and getattr(positions, on)):
        return None
    n = positions.numel()
    if isinstance(slot_mapping, dict):
        maps = {integer(g, "KV-cache group"): m for g, m in slot_mapping.items()}
        keys = sorted(maps)
        rows = [maps[g] for g in keys]
        if not all(isinstance(m, tensor) and getattr(m, on) for m in rows):
            return None
        if any(m.numel() != n for m in rows):
            raise ValueError(f"a slot mapping does not have one value per position ({n})")
        # one stream-ordered copy (no synchronisation) makes the rows one section
        slot = rows[0] if len(rows) == 1 else positions[:0] if not rows else TORCH.cat([m.reshape(-1) for m in rows])
    else:
        if not (isinstance(slot_mapping, tensor) and getattr(slot_mapping, on)) or slot_mapping.ndim not in (1, 2):
            return None
        keys = [0] if slot_mapping.ndim == 1 else list(range(slot_mapping.shape[0]))
        if slot_mapping.ndim == 2 and keys and slot_mapping.shape[1] != n or slot_mapping.ndim == 1 and (
                slot_mapping.numel() != n):
            raise ValueError(f"a slot mapping does not have one value per position ({n})")
        slot = slot_mapping
    hi = INT32_MAX if kv_groups is None else len(kv_groups) - 1
    if keys and not (0 <= keys[0] and keys[-1] <= hi):
        raise ValueError(f"KV-cache group {keys[0] if keys[0] < 0 else keys[-1]} out of range")
    seen(keys)
    return positions, slot, Groups(keys)


def copied_row(f: Field, x, rows: int, config, ranks: int = 0):
    """A row field's private host copy, checked by the field's rules (its shape against the observation's `rows`
    seq_lens rows, the config setting it needs, whole tuples of `width`, no negative value where none may be);
    None: not given, or (rows + 1 fields) of no use to replay. Raises what cannot be stored. `ranks` > 0: x is
    [ranks, values] (per_rank)."""
    a = host_fast(x) if not ranks else x
    if a is None:
        return None
    n = a.shape[-1] if ranks else a.size
    if f.shape == ROWS_PLUS_1:
        return a if n == rows + 1 else None
    if f.needs and getattr(config, f.needs) is None or f.shape == ROWS and n != rows:
        raise ValueError(f"{f.name} needs {f.needs} in the config and one value per seq_lens row ({rows})"
                         if f.needs else f"{f.name} needs one value per seq_lens row ({rows}), got {n}")
    if n % f.width:
        raise ValueError(f"{f.name} holds {f.width} values per entry, got {n}")
    return nonneg(a, f.name) if f.nonneg else a
