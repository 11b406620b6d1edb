"""The dump format v1 (docs/format.md): schema, reading, merging, writing.

The one package both sides import: the engine writes with it, the offline checks read with it. Its public
API is re-exported here; inside the package, modules import each other directly."""

from dcptool.dump.files import MemoryPlan, memory_plan, read_header  # noqa: F401
from dcptool.dump.info import (  # noqa: F401
    DumpInfo,
    describe,
)
from dcptool.dump.merge import (  # noqa: F401
    open_dumps,
    unique_files,
)
from dcptool.dump.observation import (  # noqa: F401
    FIELDS,
    FIELDS_TABLE,
    OPTIONAL_FIELDS,
    ROW_FIELDS,
    Observation,
    Record,
    Scalars,
)
from dcptool.dump.read import (  # noqa: F401
    Dump,
    read_dump,
)
from dcptool.dump.ref import match_file, obs_ref, parse_ref  # noqa: F401
from dcptool.dump.schema import (  # noqa: F401
    COLUMNS,
    FORMAT_VERSION,
    INT32_MAX,
    MAX_DCP_SIZE,
    MAX_HEADER_BYTES,
    OPTIONAL,
    RAGGED,
    REQUIRED,
    DumpConfig,
    DumpError,
    GraphMode,
    KVGroup,
    OutputExistsError,
    WriteError,
    addr_words,
    check_row_values,
    validate_columns,
    word_addrs,
)
from dcptool.dump.write import (  # noqa: F401
    atomic_write,
    check_config,
    columns,
    encode,
    encode_header,
    exists_error,
    pack,
    slot_entries,
    write_dump,
    write_observations,
    write_target,
)
