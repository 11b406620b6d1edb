"""One observation's fields, in one table both sides read, and the types built from it.

An observation is one attention-metadata build as an engine saw it. Its fields are listed once, in FIELDS_TABLE:
per field its name (observe()'s keyword), its shape rule, the dtype and column it is written to, whether it may be
None, and whether it may be a device tensor. Everything else is derived from the table: `Record` (the observation
as observe() takes it, built once at the door and passed through the recorder, the device snapshot and the Guard),
`Observation` (the public row form writers pack), `Scalars` (the checked per-observation integers a recording
keeps), the dump's columns (dump.schema), the writer's row fields, the snapshot ring's sections (engine.snapshot)
and the Guard's. Adding a field is one row here plus the code that produces it (an engine hook) and checks it (a
rule); docs/architecture.md walks through one.

This module imports nothing (the vLLM plugin reads it in every process).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, NamedTuple

# Shape rules: what a field holds per observation.
SCALAR = "scalar"  # one integer
SITE = "site"  # one string, written as an index into dcptool.config's `sites`
ANY = "any"  # a 1-D row of any length
ROWS = "rows"  # one value per seq_lens row (another length drops the observation)
ROWS_PLUS_1 = "rows+1"  # seq_lens rows + 1 values (another length: not recorded, it is of no use to replay)
TOKENS = "tokens"  # one value per token of the batch
GROUPS = "groups"  # per token and KV-cache group: 1-D (group 0), [groups, tokens] or {group: tokens}

REQUIRED = object()  # a field observe() cannot do without (no default)


class Field(NamedTuple):
    """One field of an observation: how observe() takes it and where the dump keeps it."""

    name: str  # observe()'s keyword; the attribute of Record and Observation
    shape: str  # SCALAR, SITE, ANY, ROWS, ROWS_PLUS_1, TOKENS or GROUPS
    dtype: str  # its column's safetensors dtype (I64, I32, I8)
    column: str  # its dump column: obs.<x> (one value per observation) or rows.<x> (row values)
    default: Any = None  # observe()'s default; REQUIRED: none
    device: bool = False  # may be a device tensor (a section of the snapshot ring and of the Guard's slots)
    unknown: int | None = None  # an optional scalar's value in its column where it is None
    offsets: str | None = None  # a row field's offsets column (obs.<x>, n+1 values)
    present: str | None = None  # a per-observation column saying whether the row field was given (not None)
    nonneg: bool = False  # a negative value drops the observation
    needs: str | None = None  # the DumpConfig setting the field needs (else the observation is dropped)
    section: str | None = None  # a row field's short name: the writer's rows, the ring's sections (ROW_FIELDS)
    argument: bool = True  # False: derived from other fields (a column, not an observe() keyword)
    width: int = 1  # an ANY row's values come in tuples of this many (another count drops the observation)

    @property
    def optional(self) -> bool:
        """None is a value the field may take (not recorded, or unknown)."""
        return self.default is not REQUIRED and self.shape != SITE and (self.shape != SCALAR or self.unknown is
                                                                        not None)

    @property
    def always(self) -> bool:
        """Its columns are in every dump (required, or None recorded by a presence column)."""
        return not self.optional or self.present is not None

    @property
    def rows(self) -> bool:
        """A row field (an array per observation), not a scalar."""
        return self.shape not in (SCALAR, SITE)


def _scalar(name: str, dtype: str, default: Any = REQUIRED, unknown: int | None = None) -> Field:
    return Field(name, SCALAR, dtype, f"obs.{name}", default, unknown=unknown)


# The table. Its order is Observation's (required fields first); the row fields' order is the ring's sections'.
FIELDS_TABLE: tuple[Field, ...] = (
    _scalar("step", "I64"),
    Field("site", SITE, "I32", "obs.site", REQUIRED),
    _scalar("rank", "I32"),
    _scalar("num_reqs", "I32"),
    _scalar("num_reqs_padded", "I32"),
    Field("seq_lens", ANY, "I32", "rows.seq_lens", REQUIRED, device=True, offsets="obs.rows", nonneg=True,
          section="seq"),
    Field("dcp_local_seq_lens", ANY, "I32", "rows.dcp_local_seq_lens", device=True, offsets="obs.dcp_rows",
          present="obs.has_dcp", section="dcp"),
    _scalar("ubatch", "I32", -1),
    _scalar("parent", "I64", None, unknown=-1),
    _scalar("req_start", "I32", None, unknown=-1),
    _scalar("tok_start", "I32", None, unknown=-1),
    _scalar("tok_stop", "I32", None, unknown=-1),
    Field("query_start_loc", ROWS_PLUS_1, "I32", "rows.query_start_loc", device=True, offsets="obs.qsl",
          section="qsl"),
    _scalar("num_tokens_padded", "I32", None, unknown=-1),
    _scalar("buffer", "I64", None, unknown=0),
    _scalar("graph", "I8", None, unknown=0),
    Field("kv_pages", ROWS, "I32", "rows.kv_pages", device=True, offsets="obs.rows", needs="page_size",
          section="kv"),
    Field("dcp_query_start_loc", ANY, "I32", "rows.dcp_query_start_loc", device=True, offsets="obs.dqsl",
          section="dqsl"),
    Field("dcp_tot_seq_lens", ANY, "I32", "rows.dcp_tot_seq_lens", device=True, offsets="obs.tot", nonneg=True,
          section="tot"),
    Field("positions", TOKENS, "I32", "rows.positions", device=True, offsets="obs.slots", nonneg=True,
          section="pos"),
    Field("slot_mapping", GROUPS, "I32", "rows.slot_mapping", device=True, offsets="obs.slots", section="slot"),
    Field("slot_group", GROUPS, "I32", "rows.slot_group", offsets="obs.slots", section="sgrp", argument=False),
    # MLA's chunked prefill context (dcp.chunks): max_context_chunk, then (chunk, row, start, length) per entry
    Field("ctx_chunks", ANY, "I32", "rows.ctx_chunks", device=True, offsets="obs.ctx", nonneg=True, section="ctx"),
    # per KV-cache group (kv_groups order), the lengths its attention metadata reads: one value per seq_lens row each
    Field("group_seq_lens", ANY, "I32", "rows.group_seq_lens", device=True, offsets="obs.gsl", nonneg=True,
          section="gsl"),
    # per query token of the batch (a prefix: its decode tokens), the rank-local KV length it attends to
    Field("verify_row_lens", ANY, "I32", "rows.verify_row_lens", device=True, offsets="obs.vrl", section="vrl"),
    # sparse MLA (dcp.topk): per query token of the batch (a prefix of its tokens), three values: the fingerprint of
    # its global top-k set, how many of the set's entries this rank owns, the state of the rank's partial result
    Field("sparse_topk", ANY, "I32", "rows.sparse_topk", device=True, offsets="obs.topk", nonneg=True,
          section="topk"),
    # The per-request metadata tensors the build hands attention (dcptool.config's attn_tensors names them, in this
    # order): each one's address (data_ptr) as two int32 words, low then high (addr_words); at a full-graph replay,
    # the addresses the graph captured for them (it reads those, whatever the build wrote)
    Field("attn_addrs", ANY, "I32", "rows.attn_addrs", offsets="obs.addrs", section="addr"),
    Field("graph_addrs", ANY, "I32", "rows.graph_addrs", offsets="obs.gaddrs", section="gaddr"),
    # ... and the request rows the buffer behind each one holds from the tensor's start (its capacity: a build
    # needs num_reqs_padded of them; a buffer sized below the largest padded batch truncates views, writes past it)
    Field("attn_caps", ANY, "I32", "rows.attn_caps", offsets="obs.caps", nonneg=True, section="caps"),
    # The host copy of seq_lens the build's metadata builder read (seq_lens_cpu), as it read it and as the build left
    # it: a copy the device's lengths have moved past (async scheduling), or one a builder wrote in place (shared
    # with the builds after it)
    Field("host_seq_lens", ANY, "I32", "rows.host_seq_lens", offsets="obs.hseq", section="hseq"),
    Field("host_seq_lens_after", ANY, "I32", "rows.host_seq_lens_after", offsets="obs.hseq_after", section="hseqa"),
    # FlashInfer's native plans beside kv_pages (its decode rows): the page counts of its prefill rows (a DCP prefill
    # row's plan covers its local context, seq_len - query_len; -1 on decode rows and where no kernel reads them) and
    # every planned row's last-page length (-1 where none is read)
    Field("kv_prefill_pages", ROWS, "I32", "rows.kv_prefill_pages", offsets="obs.rows", needs="page_size",
          section="kvpre"),
    Field("kv_last_page", ROWS, "I32", "rows.kv_last_page", offsets="obs.rows", needs="page_size", section="klast"),
    # Per KV-cache group (rows.slot_group's index, in order), the block sizes the build's slot mapping worked with:
    # three words each, the KV-cache manager's block (its spec's block_size), the attention kernel's block
    # (kernel_block_sizes) and the block whose virtual block (it times dcp_size) deals positions to the DCP ranks
    Field("kv_block_sizes", ANY, "I32", "rows.kv_block_sizes", offsets="obs.kvbs", nonneg=True, section="kvbs",
          width=3),
)

ARGUMENTS: tuple[Field, ...] = tuple(f for f in FIELDS_TABLE if f.argument)  # observe()'s keywords
NAMES: tuple[str, ...] = tuple(f.name for f in ARGUMENTS)
SCALAR_FIELDS: tuple[Field, ...] = tuple(f for f in FIELDS_TABLE if f.shape == SCALAR)
ROW_TABLE: tuple[Field, ...] = tuple(f for f in FIELDS_TABLE if f.rows)  # the row fields, sections in this order
# the host values: the row fields after the last device one (the metadata tensors' addresses, capacities ...), which
# the snapshot ring holds beside its slots and the Guard checks on the host
HOST_ROWS: tuple[Field, ...] = ROW_TABLE[max(k for k, f in enumerate(ROW_TABLE) if f.device or f.section == "sgrp")
                                         + 1:]
FIELDS: tuple[str, ...] = tuple(f.name for f in SCALAR_FIELDS)  # a recording's checked integers, in Scalars order
ROW_FIELDS: tuple[str, ...] = tuple(f.section for f in ROW_TABLE)  # the writer's rows, in this order
# Optional per-observation columns: field -> (column, numpy dtype, value written where unknown).
_NUMPY = {"I64": "<i8", "I32": "<i4", "I8": "i1", "U8": "u1"}
OPTIONAL_FIELDS: dict[str, tuple[str, str, int]] = {
    f.name: (f.column, _NUMPY[f.dtype], f.unknown) for f in SCALAR_FIELDS if f.optional}


def numpy_dtype(f: Field) -> str:
    """The numpy dtype of a field's column ("<i8", "<i4", "i1")."""
    return _NUMPY[f.dtype]


def _index(name: str, fields: tuple[Field, ...]) -> int:
    return next(i for i, f in enumerate(fields) if f.name == name)


# Record: the observation as observe() takes it (engine tensors, host arrays, Python ints; nothing checked yet),
# built once at the door (Recorder.observe, Guard.observe, the vLLM plugin, simulate) with tuple.__new__ where it is
# hot, and passed whole.
_DEFAULTS = tuple(f.default for f in ARGUMENTS if f.default is not REQUIRED)
if any(f.default is REQUIRED for f in ARGUMENTS[len(ARGUMENTS) - len(_DEFAULTS):]):
    raise ImportError("dump.observation.FIELDS_TABLE: the required fields must come first")
Record = collections.namedtuple("Record", NAMES, defaults=_DEFAULTS, module=__name__)
Record.__doc__ = "One observation as observe() takes it (dump.observation.FIELDS_TABLE's arguments, in its order)."

# Scalars: a recording's per-observation integers once checked (Python ints; None where unknown), in FIELDS order.
Scalars = NamedTuple("Scalars", [(f.name, "int | None") for f in SCALAR_FIELDS])
Scalars.__doc__ = "An observation's integers as a recording keeps them (checked), in dump.observation.FIELDS order."

# Positions of fields the hot paths read by index (a Record or a Scalars is a tuple).
R = {f.name: i for i, f in enumerate(ARGUMENTS)}
S = {f.name: i for i, f in enumerate(SCALAR_FIELDS)}


def _observation_class() -> type:
    """The public row form (a dataclass: mutable, `__dict__`), one attribute per observe() keyword."""
    kinds = {SCALAR: "int", SITE: "str"}

    def annotation(f: Field) -> str:
        t = kinds.get(f.shape, "np.ndarray | dict" if f.shape == GROUPS else "np.ndarray")
        return t if f.default is REQUIRED or (f.shape == SCALAR and not f.optional) else f"{t} | None"

    cls = dataclasses.make_dataclass(
        "Observation", [(f.name, annotation(f)) if f.default is REQUIRED else
                        (f.name, annotation(f), dataclasses.field(default=f.default)) for f in ARGUMENTS],
        namespace={"__doc__": "One attention-metadata build as an engine saw it (the row form of the columnar "
                              "dump; fields: dump.observation.FIELDS_TABLE)."})
    cls.__module__ = __name__
    return cls


Observation = _observation_class()


def dump_columns() -> tuple[dict[str, tuple[str, str]], dict[str, tuple[str, str]]]:
    """The dump's (REQUIRED, OPTIONAL) columns: key -> (dtype, length kind), the length kind "n" (one value per
    observation), "n+1" (offsets) or the offsets column that sizes a row column. Per field of the table, in its
    order: its presence column, its offsets (with the first field that has them), its own column."""
    req: dict[str, tuple[str, str]] = {}
    opt: dict[str, tuple[str, str]] = {}
    for f in FIELDS_TABLE:
        out = req if f.always else opt
        if not f.rows:
            out[f.column] = (f.dtype, "n")
            continue
        if f.present is not None:
            out[f.present] = ("U8", "n")
        if f.offsets not in req and f.offsets not in opt:
            out[f.offsets] = ("I64", "n+1")
        out[f.column] = (f.dtype, f.offsets)
    return req, opt


def keyword_door(name: str, method: str, doc: str, renames: dict[str, str] | None = None,
                 returns: str = "int", fast: str | None = None) -> Any:
    """A method `name(self, *, <one keyword per field of the table>)` returning `self.<method>(record)`, the
    record built from its keywords with tuple.__new__ (the cheapest way: observe() is an engine's hot path).

    observe()'s keywords are the table's arguments, in its order, with their defaults (`renames`: other keywords
    for some fields, observe_many's ranks/parents/buffers): a field added to the table is a keyword of observe()
    at once. Generated as namedtuple and dataclasses generate __init__, so that the keywords are bound as plain
    parameters (a **kwargs door would build a dict and bind it again per call: docs/performance.md). `fast`: the
    name of an attribute of self holding a callable or None (a fast path, tried first; it returns None for what it
    does not take, and never raises), so that the engine's common case costs no call of `method`."""
    renames = renames or {}
    ns: dict[str, Any] = {"_new": tuple.__new__, "_Record": Record}
    params = []
    for f in ARGUMENTS:
        kw = renames.get(f.name, f.name)
        if f.default is REQUIRED:
            params.append(kw)
        else:
            ns[f"_default_{kw}"] = f.default
            params.append(f"{kw}=_default_{kw}")
    values = ", ".join(renames.get(f.name, f.name) for f in ARGUMENTS)
    first = "" if fast is None else (f"    fast = self.{fast}\n    if fast is not None:\n        got = fast(r)\n"
                                     "        if got is not None:\n            return got\n")
    exec(f"def {name}(self, *, {', '.join(params)}):\n    r = _new(_Record, ({values},))\n{first}"
         f"    return self.{method}(r)\n", ns)
    fn = ns[name]
    fn.__doc__ = doc
    fn.__annotations__ = {f.name: "str" if f.shape == SITE else "int | None" if f.optional else "int"
                          for f in ARGUMENTS if not f.rows and f.name not in renames} | {"return": returns}
    return fn
