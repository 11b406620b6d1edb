"""dcptool: replay and debug decode-context-parallel (DCP) metadata recorded from serving engines."""

__version__ = "0.1.0"
__all__ = ["DcptoolError", "DumpConfig", "DumpError", "Guard", "Observation", "Recorder", "__version__"]


def __getattr__(name: str):
    # Lazy: `dcptool --help` needs neither numpy (dump) nor torch (record).
    if name in ("DumpConfig", "DumpError", "Observation"):
        from dcptool import dump

        return getattr(dump, name)
    if name == "DcptoolError":
        from dcptool.errors import DcptoolError

        return DcptoolError
    if name == "Recorder":
        from dcptool.engine.recorder.record import Recorder

        return Recorder
    if name == "Guard":
        from dcptool.engine.guard.guard import Guard

        return Guard
    raise AttributeError(name)
