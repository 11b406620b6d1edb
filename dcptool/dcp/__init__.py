"""DCP's domain rules as code (DESIGN §1 and §3): the local-length formula, the rule table, vLLM's kernel and the fused
check kernels, micro-batch slicing and the PCP partition, ragged segments. Shared by the engine side and the offline
checks."""
