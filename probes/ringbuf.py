"""A BPF ring buffer consumer over mmap, reading records in bulk.

BCC's `ring_buffer_poll` calls back into Python through ctypes once per record; at hundreds of
thousands of records a second that call is most of the consumer's cost. Here the consumer page and
the data pages are mapped directly, every committed record up to the producer position is sliced
out in one Python loop, and the consumer position is advanced once per batch. Waiting is an epoll
on the map's descriptor. The kernel offers the data area twice, back to back, so that a record
never wraps; we map it once (every page of such a mapping is resident at once: a second copy would
add the ring's whole size to the recorder's RSS) and put the rare record that wraps together.

Layout (kernel/bpf/ringbuf.c): page 0 = consumer_pos (read-write); page 1 = producer_pos
(read-only); then the data area twice. Each record starts with an 8-byte header: u32 length with
BUSY (bit 31) and DISCARD (bit 30) flags, u32 page offset. Records are 8-byte aligned.

The producer reads consumer_pos, without a lock, at every reservation, and refuses one when
`new producer_pos - consumer_pos` exceeds the ring's size. So the consumer position must change in
one aligned 8-byte store from its old value to its new one: never through `struct.pack_into`,
which zeroes its destination before it writes the value. A producer that read the 0 in between,
once it had gone round the ring (its position past the ring's size), found the ring full and
dropped the record, however empty the ring was (`bench/bench.py` case `open10`: 17-40 records
lost per million).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import select
import struct
from collections.abc import Callable

_BUSY = 1 << 31
_DISCARD = 1 << 30
_HDR = 8
_U32 = struct.Struct("<I")


class RingBuffer:
    def __init__(self, map_fd: int, data_size: int) -> None:
        if data_size <= 0 or data_size & (data_size - 1):
            raise ValueError("ring buffer size must be a power of two")
        page = mmap.PAGESIZE
        self.size = data_size
        self.mask = data_size - 1
        self._cons = mmap.mmap(map_fd, page, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=0)
        self._prod = mmap.mmap(map_fd, page + data_size, mmap.MAP_SHARED, mmap.PROT_READ, offset=page)
        self._data = memoryview(self._prod)[page:]
        # the positions through 8-byte views: one aligned load or store each (memoryview sets a
        # 'Q' with one memcpy of 8 bytes), never struct.pack_into (see the module's docstring)
        self._cons_pos = memoryview(self._cons).cast("Q")
        self._prod_pos = memoryview(self._prod)[:page].cast("Q")
        self._page = page
        self.stitched = 0  # records that wrapped past the end of the data area (put together)
        self._epoll = select.epoll()
        self._epoll.register(map_fd, select.EPOLLIN)
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._epoll.register(self._wake, select.EPOLLIN)

    def wait(self, timeout_ms: int) -> None:
        """Sleep until the kernel signals data, wake() is called, or the timeout ends."""
        for fd, _ in self._epoll.poll(timeout_ms / 1000.0, 2):
            if fd == self._wake:
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(self._wake)

    def wake(self) -> None:
        """Make a wait() in another thread return now (a drain or a shutdown is waiting)."""
        os.eventfd_write(self._wake, 1)

    @property
    def position(self) -> int:
        """The consumer position: bytes consumed since the ring was created (headers included)."""
        return int(self._cons_pos[0])

    # the same loop compiled (agent/recorder/pipeline.py sets it: evidence.bundle._fast.ring_read)
    fast_read: Callable[[memoryview, memoryview, int, int], tuple[list[bytes], int, int]] | None = None

    def read(self, max_records: int = 65536) -> list[bytes]:
        """Every committed record available now (up to max_records), oldest first."""
        if self.fast_read is not None:
            got, after, stitched = self.fast_read(self._data, self._prod_pos, self._cons_pos[0], max_records)
            self.stitched += stitched
            self._cons_pos[0] = after
            return got
        cons = self._cons_pos[0]
        prod = self._prod_pos[0]
        out: list[bytes] = []
        data = self._data
        mask = self.mask
        while cons < prod and len(out) < max_records:
            off = cons & mask
            hdr = _U32.unpack_from(data, off)[0]
            if hdr & _BUSY:
                break  # reserved, not yet committed: read it next time
            length = hdr & ~(_BUSY | _DISCARD)
            if not hdr & _DISCARD:
                start = (off + _HDR) & mask  # the header never wraps: records are 8-byte aligned
                end = start + length
                if end <= self.size:
                    out.append(bytes(data[start:end]))
                else:
                    out.append(bytes(data[start:]) + bytes(data[: end - self.size]))
                    self.stitched += 1
            cons += (length + _HDR + 7) & ~7
            # re-read the producer position now and then: records keep arriving while we read
            if cons >= prod:
                prod = self._prod_pos[0]
        self._cons_pos[0] = cons
        return out

    def close(self) -> None:
        self._epoll.close()
        os.close(self._wake)
        self._data.release()
        self._cons_pos.release()
        self._prod_pos.release()
        self._prod.close()
        self._cons.close()
