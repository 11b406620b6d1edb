"""Working with recordings beyond replay: diff two runs, reduce one to a minimal case, export it as a test."""
