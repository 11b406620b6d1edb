"""Hand-made dump files for tests/dump: a small packed dump, and its header and data rewritten without validation."""

import json
import struct

import numpy as np
from conftest import obs

from dcptool.dump import DumpConfig, encode, pack


def _cols(n=3, **over):
    cfg, cols = pack([obs(step=i, rank=i % 2) for i in range(n)], DumpConfig(dcp_size=2))
    cols.update(over)
    return cfg, cols


def _raw(path, header: dict, data: bytes = b"") -> str:
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)
    return str(path)


def _header_and_data(cfg, cols, injected=None):
    head, tensors = encode(cfg, cols, injected)
    hlen = struct.unpack("<Q", head[:8])[0]
    return json.loads(head[8 : 8 + hlen]), b"".join(a.tobytes() for _, a in tensors)


def _bad(tmp_path, mutate) -> str:
    cfg, cols = _cols()
    header, data = _header_and_data(cfg, cols)
    out = mutate(header, data)
    if isinstance(out, tuple):
        header, data = out
    return _raw(tmp_path / "bad.safetensors", header, data)


def _set(col, values):
    def m(header, data):
        arr = np.asarray(values)
        e = header[col]
        a, b = e["data_offsets"]
        raw = arr.astype({"I64": "<i8", "I32": "<i4", "U8": "u1", "I8": "i1"}[e["dtype"]]).tobytes()
        assert len(raw) == b - a
        return header, data[:a] + raw + data[b:]
    return m
