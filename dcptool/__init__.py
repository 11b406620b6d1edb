"""dcptool: replay and debug decode-context-parallel (DCP) metadata recorded from serving engines."""

from dcptool.dump import DumpConfig, DumpError, Observation

__version__ = "0.1.0"
__all__ = ["DumpConfig", "DumpError", "Observation", "Recorder", "__version__"]


def __getattr__(name: str):
    # Recorder pulls in torch; keep `import dcptool` (and `dcptool --help`) light.
    if name == "Recorder":
        from dcptool.record import Recorder

        return Recorder
    raise AttributeError(name)
