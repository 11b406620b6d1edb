"""What runs inside the serving engine; imports nothing of the CLI or the offline checks.

Subpackages, from the top: `vllm` (the vLLM plugin), `guard` (the Guard: each observation checked as it is made),
`recorder` (the Recorder: observations kept and written), `snapshot` (the device path: the pinned ring, its kernels
and launches); `arguments` (observe()'s arguments checked) under them all."""
