"""What runs inside the serving engine: the Recorder, its device snapshot ring and kernel, the file writer, the vLLM
plugin. Imports nothing of the CLI or the offline checks."""
