"""The Recorder: each observation checked at the door, kept, and written atomically to numbered files."""
