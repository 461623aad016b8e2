"""A real filesystem that fills up: a tmpfs of a few hundred KiB that the test mounts, and a filler file on it.

Writes on it fail with ``ENOSPC`` once it is full, as on a production disk; deleting the filler gives the
space back. Mounting needs root (the CI containers and the dev machine run tests as root).
"""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path


class SmallDisk:
    """A tmpfs of ``size_bytes`` mounted at ``path`` until :meth:`unmount`."""

    def __init__(self, path: Path, size_bytes: int) -> None:
        self.path, self.size_bytes = path, size_bytes
        path.mkdir(parents=True, exist_ok=True)
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)],
                                 capture_output=True, text=True)
        if mounted.returncode != 0:
            raise RuntimeError(f"cannot mount a {size_bytes}-byte tmpfs at {path} (the full-disk tests mount one; "
                               f"they need root): {mounted.stderr.strip()}")
        self.filler = path / "filler"

    def fill(self, leave_bytes: int) -> None:
        """Write a filler file until about ``leave_bytes`` are left free."""
        with self.filler.open("ab", buffering=0) as filler:
            block = b"\0" * 4096
            while self.free_bytes() > leave_bytes:
                try:
                    filler.write(block)
                except OSError as error:
                    if error.errno != errno.ENOSPC:
                        raise
                    break

    def free(self) -> None:
        """Delete the filler: the space comes back."""
        self.filler.unlink(missing_ok=True)

    def free_bytes(self) -> int:
        stats = os.statvfs(self.path)
        return stats.f_bavail * stats.f_frsize

    def unmount(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], check=False, capture_output=True)
