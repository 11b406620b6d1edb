"""DCP's domain rules as code (DESIGN §1): the local-length formula, vLLM's kernel, micro-batch slicing and the PCP
partition, ragged segments. Shared by the engine side and the offline checks."""
