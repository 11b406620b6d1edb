"""The root of dcptool's exceptions (stdlib only: cli.py imports it for `dcptool --help`)."""


class DcptoolError(Exception):
    """Bad input or usage that dcptool explains in one line (the CLI prints it and exits 2): DumpError and
    its family, LimitError, SimError, BackendError and the CLI's own Trouble all derive from it."""
