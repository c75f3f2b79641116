"""FlowInfo and FlowFlag: the per-transaction header that travels with fed and fetched data."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class FlowFlag(enum.IntFlag):
    """Flags of a transaction: end of stream, segment."""

    DATA_FLOW_FLAG_EOS = 1 << 0
    DATA_FLOW_FLAG_SEG = 1 << 1


_USER_DATA_MAX = 64


@dataclass
class FlowInfo:
    """Transaction header: id (from 1), flags, times (µs since the epoch) and up to 64 user bytes."""

    start_time: int = 0
    end_time: int = 0
    flow_flags: int = 0
    transaction_id: int = 0
    user_data: bytes = b""

    def set_user_data(self, data: bytes, offset: int = 0) -> None:
        """Store user bytes at `offset`; at most 64 bytes in all."""
        data = bytes(data)
        if offset < 0 or offset + len(data) > _USER_DATA_MAX:
            raise ValueError(
                f"user data of {len(data)} bytes at offset {offset} exceeds {_USER_DATA_MAX} bytes"
            )
        buf = bytearray(self.user_data.ljust(offset + len(data), b"\0"))
        buf[offset : offset + len(data)] = data
        self.user_data = bytes(buf)

    def get_user_data(self, size: int | None = None, offset: int = 0) -> bytes:
        end = len(self.user_data) if size is None else offset + size
        return self.user_data[offset:end]

    @property
    def eos(self) -> bool:
        return bool(self.flow_flags & FlowFlag.DATA_FLOW_FLAG_EOS)
