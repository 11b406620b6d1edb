"""The root of dcptool's exceptions (stdlib only: cli.py imports it for `dcptool --help`)."""


class DcptoolError(Exception):
    """Bad input or usage that dcptool explains in one line (the CLI prints it and exits 2): DumpError and
    its family, LimitError, SimError, BackendError and the CLI's own Trouble all derive from it."""


class UsageError(DcptoolError):
    """An option or argument given wrong: the CLI prints `dcptool COMMAND: OPTION: what is wrong` and exits 2."""

    def __init__(self, option: str, what: str):
        self.option, self.what = option, what
        super().__init__(f"{option}: {what}")
