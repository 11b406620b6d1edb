"""The model of vLLM's runner and the simulator that drives it (dcptool simulate)."""
