"""Reading a small file a user names (a workload, a secret), refusing what is no file or too big.

``/dev/zero`` would be read until memory runs out, and a FIFO would block the reader until
someone writes to it. :func:`read_small_file` opens without blocking, takes only a regular
file (a link to one is fine) and reads at most ``max_bytes``, whatever the file grows to.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .errors import GpufleetError

_KINDS = {stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
          stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a folder"}  # fmt: skip


class NotASmallFileError(GpufleetError, OSError):
    """The path is not a regular file, or the file is larger than allowed."""


def read_small_file(path: str | os.PathLike[str], max_bytes: int) -> bytes:
    """The content of the regular file at ``path``, at most ``max_bytes`` long.

    Raises:
        NotASmallFileError: it is a FIFO, a device, a socket or a folder, or it holds more than
            ``max_bytes`` bytes (the message says which, and the limit).
        OSError: it cannot be opened (``FileNotFoundError``, ``PermissionError``, ...).
    """
    p = Path(path)
    fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO must not block the open
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
            raise NotASmallFileError(f"{p} is {kind}, not a regular file")
        chunks, size = [], 0
        while size <= max_bytes:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > max_bytes:
            raise NotASmallFileError(f"{p} is larger than {max_bytes:,} bytes, the most gpufleet reads here")
        return b"".join(chunks)
    finally:
        os.close(fd)
