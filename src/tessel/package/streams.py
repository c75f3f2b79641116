"""Reading a package member's bytes from the file in pieces, each hashed as it arrives, so a
member is checked against its checksum without a second pass or a second copy. No torch."""

from __future__ import annotations

from typing import Protocol

CHUNK = 16 << 20  # bytes read at a time


class Stream(Protocol):
    """A binary file being read: a member of a package, or bytes in memory."""

    def readinto(self, buffer: memoryview, /) -> int | None: ...


class Digest(Protocol):
    """A running hash (`hashlib`'s)."""

    def update(self, data: memoryview, /) -> None: ...


def read_into(stream: Stream, view: memoryview, digest: Digest) -> None:
    """Fill `view` from `stream`, `digest` taking every byte; `EOFError` if it ends first."""
    got = 0
    while got < len(view):
        n = stream.readinto(view[got : got + CHUNK])
        if not n:
            raise EOFError(f"the data ends after {got} of {len(view)} bytes")
        digest.update(view[got : got + n])
        got += n


def skip(stream: Stream, count: int, digest: Digest) -> None:
    """Read past `count` bytes that nothing keeps (still hashed)."""
    scratch = memoryview(bytearray(min(count, CHUNK)))
    while count > 0:
        read_into(stream, scratch[: min(count, len(scratch))], digest)
        count -= len(scratch)
