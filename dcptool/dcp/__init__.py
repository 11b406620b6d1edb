"""DCP's domain rules as code (docs/dcp.md, docs/replay.md#the-rules): the local-length formula, the rule table,
vLLM's kernel and the fused check kernels, micro-batch slicing and the PCP partition, ragged segments. Shared by the
engine side and the offline checks."""
