"""One recording per path on a host: a Recorder holds its path through an exclusive lock on a hidden file beside it."""

from __future__ import annotations

import errno
import os
from pathlib import Path

try:
    import fcntl
except ImportError:  # (no flock on this system: the per-write existence check still guards)
    fcntl = None


class Claim:
    """`path` held by this process: an exclusive flock(2) on `.NAME.lock` in the path's directory.

    flock works between any processes that see the file (network namespaces and containers sharing the directory
    alike), between two Recorders of one process (each lock is its own open file), and the kernel drops it when
    the holder dies, so a killed recording holds nothing. release() removes the lock file; one a killed holder
    left is locked again (and removed) by the next recording of the path. The lock is on the file the path names
    now (the holder checks it locked the file still there: a release that removed it meanwhile makes it retry)."""

    def __init__(self, fd: int | None, lock: Path | None):
        self._fd, self.lock = fd, lock

    @classmethod
    def take(cls, path: Path) -> Claim | None:
        """Hold `path`; None when another Recorder holds it. Where no lock file can be made here (no flock, a
        directory that does not exist yet or cannot be written) the claim holds nothing (the writes still refuse
        to replace a file another writer made)."""
        lock = Path(os.path.realpath(path.parent)) / f".{path.name}.lock"
        if fcntl is None:
            return cls(None, None)
        for _ in range(100):
            try:
                fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError:
                return cls(None, None)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    return None  # held by another Recorder
                return cls(None, None)  # (a filesystem without flock)
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(lock))
            except OSError:
                same = False
            if same:
                return cls(fd, lock)
            os.close(fd)  # (its holder released it meanwhile: lock the file there now)
        return cls(None, None)

    @property
    def held(self) -> bool:
        """A lock is held (False: this system or directory has none to take)."""
        return self._fd is not None

    def release(self) -> None:
        """Give the path up (removing the lock file first, while still holding it); safe to call twice."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.unlink(self.lock)
        except OSError:
            pass
        os.close(fd)
