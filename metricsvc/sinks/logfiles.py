"""Readers for the files backends write, so a restarted sink can see what they already hold.

- LevelDB-log framing (wandb's ``.wandb`` transaction log, SwanLab's ``.swanlab`` file): a
  7-byte file header, then 32 KiB blocks of records ``crc32 | length | type | data``.
- TFRecord framing (TensorBoard event files): ``length | crc | data | crc``.

Both readers stop at the first record that is incomplete or fails its check: that is where
a killed writer stopped, and nothing after it was durable.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

_BLOCK = 32768
_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


class LevelDBLogTail:
    """Reads the complete records of a LevelDB-log file, resuming where it last stopped."""

    def __init__(self, path: Path, ident: bytes) -> None:
        self.path = Path(path)
        self.ident = ident
        self.pos = 0  # just past the last whole record read

    def read_new(self) -> list[bytes]:
        """Return the records completed since the last call (none if the file is missing)."""
        try:
            with open(self.path, "rb") as fh:
                if self.pos == 0:
                    head = fh.read(_HEADER)
                    if len(head) < _HEADER:
                        return []
                    if head[:4] != self.ident:
                        raise ValueError(f"{self.path} does not start with {self.ident!r}")
                    self.pos = _HEADER
                fh.seek(self.pos)
                raw = fh.read()
        except FileNotFoundError:
            return []
        records: list[bytes] = []
        base, at, pending = self.pos, 0, b""
        while True:
            left = _BLOCK - (base + at) % _BLOCK
            if left < _HEADER:
                at += left  # block trailer padding
                continue
            if at + _HEADER > len(raw):
                break
            crc, length, kind = struct.unpack_from("<IHB", raw, at)
            if length == 0 and kind == 0:
                at += left  # zero padding up to the block end
                continue
            data = raw[at + _HEADER: at + _HEADER + length]
            if len(data) < length or zlib.crc32(data, zlib.crc32(bytes([kind]))) != crc:
                break  # torn or not yet written: stop here, retry from here next time
            at += _HEADER + length
            if kind == _FULL:
                records.append(data)
                self.pos = base + at
            elif kind == _FIRST:
                pending = data
            elif kind == _MIDDLE:
                pending += data
            elif kind == _LAST:
                records.append(pending + data)
                pending = b""
                self.pos = base + at
            else:
                break
        return records


def _masked_crc32c(data: bytes) -> int:
    from tensorboardX.crc32c import crc32c  # optional backend: imported only when used

    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecords(path: Path) -> list[bytes]:
    """Return the whole records of a TFRecord file (a TensorBoard event file).

    Each record's header is checked (its CRC, and that the record fits in the file); the
    data's CRC is not, since crc32c in pure Python would cost seconds per MiB at restart,
    and an append-only file killed mid-write leaves a short record, which the length
    check catches.
    """
    raw = Path(path).read_bytes()
    out, at = [], 0
    while at + 12 <= len(raw):
        header = raw[at: at + 8]
        (length,) = struct.unpack("<Q", header)
        (header_crc,) = struct.unpack_from("<I", raw, at + 8)
        if header_crc != _masked_crc32c(header) or at + 16 + length > len(raw):
            break
        out.append(raw[at + 12: at + 12 + length])  # the data's own CRC: see the docstring
        at += 16 + length
    return out
