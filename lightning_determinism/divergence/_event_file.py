"""A minimal reader of TensorBoard event files: the hyperparameters and the texts a run logged, nothing else.

An event file is a sequence of TFRecords (length, CRC, an ``Event`` protocol buffer, CRC). This module decodes just
the fields the determinism record travels in — ``Event.step``, ``Event.summary.value[].tag``, a value's plugin data
(the ``hparams`` plugin's ``session_start_info``) and a text summary's string tensor — with the standard library, so
the command line reads a ``TensorBoardLogger``'s directory without TensorBoard, ``tensorboardX`` or ``protobuf``
installed. The field numbers are those of TensorBoard's ``event.proto``, ``summary.proto``, ``tensor.proto`` and the
hparams plugin's ``plugin_data.proto`` (stable: protocol buffers never renumber a field). CRCs are not checked; a
record cut short (a writer still open, a killed run) ends the file.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_VARINT, _FIXED64, _BYTES, _FIXED32 = 0, 1, 2, 5


class EventFileError(ValueError):
    """An event file whose bytes are not the protocol buffers they should be."""


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise EventFileError("a truncated or overlong varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def fields(data: bytes) -> Iterator[tuple[int, int, Any]]:
    """``(field number, wire type, value)`` of each field of one message: ints, or ``bytes`` for nested ones.

    Examples:
        >>> list(fields(bytes([0x10, 0x07, 0x1A, 0x02]) + b"hi"))
        [(2, 0, 7), (3, 2, b'hi')]
    """
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        value: Any
        if wire == _VARINT:
            value, pos = _varint(data, pos)
        elif wire == _FIXED64:
            value, pos = data[pos : pos + 8], pos + 8
        elif wire == _BYTES:
            length, pos = _varint(data, pos)
            value, pos = data[pos : pos + length], pos + length
        elif wire == _FIXED32:
            value, pos = data[pos : pos + 4], pos + 4
        else:
            raise EventFileError(f"wire type {wire} of field {number} is not one this reader knows")
        if pos > len(data):
            raise EventFileError(f"field {number} runs past the end of its message")
        yield number, wire, value


def records(path: Path) -> Iterator[bytes]:
    """The TFRecords of a file, in order; a record cut short ends it."""
    data = path.read_bytes()
    pos = 0
    while pos + 12 <= len(data):
        (length,) = struct.unpack_from("<Q", data, pos)
        start = pos + 12  # the length (8 bytes), then its CRC (4)
        if start + length + 4 > len(data):
            return
        yield data[start : start + length]
        pos = start + length + 4


def _protobuf_value(data: bytes) -> Any:
    """A ``google.protobuf.Value``: ``None``, a float, a str or a bool (lists and structs as ``None``)."""
    for number, _, value in fields(data):
        if number == 2:
            return struct.unpack("<d", value)[0]
        if number == 3:
            return value.decode("utf-8", "replace")
        if number == 4:
            return bool(value)
    return None


def _session_start_hparams(content: bytes) -> dict[str, Any]:
    """The hyperparameters of a ``HParamsPluginData`` that holds a ``session_start_info`` (else ``{}``)."""
    out: dict[str, Any] = {}
    for number, _, start_info in fields(content):
        if number != 3:
            continue
        for field, _, entry in fields(start_info):
            if field != 1:
                continue
            key, value = "", None
            for part, _, raw in fields(entry):
                if part == 1:
                    key = raw.decode("utf-8", "replace")
                elif part == 2:
                    value = _protobuf_value(raw)
            out[key] = value
    return out


def _summary_value(data: bytes) -> tuple[str, str | None, bytes, list[str]]:
    """A ``Summary.Value``: its tag, plugin name, plugin content and string tensor values."""
    tag, plugin, content, strings = "", None, b"", []
    for number, _, value in fields(data):
        if number == 1:
            tag = value.decode("utf-8", "replace")
        elif number == 9:  # SummaryMetadata
            for field, _, raw in fields(value):
                if field == 1:  # PluginData
                    for part, _, item in fields(raw):
                        if part == 1:
                            plugin = item.decode("utf-8", "replace")
                        elif part == 2:
                            content = item
        elif number == 8:  # TensorProto
            strings = [raw.decode("utf-8", "replace") for field, _, raw in fields(value) if field == 8]
    return tag, plugin, content, strings


def _values(path: Path) -> Iterator[tuple[int, str, str | None, bytes, list[str]]]:
    """Every summary value of the file: its event's step, then :func:`_summary_value`'s fields."""
    for record in records(path):
        step = 0
        values: list[bytes] = []
        for number, _, value in fields(record):
            if number == 2:
                step = value - (1 << 64) if value >= 1 << 63 else value
            elif number == 5:  # Summary
                values.extend(raw for field, _, raw in fields(value) if field == 1)
        for raw in values:
            yield (step, *_summary_value(raw))


def session_hparams(path: Path) -> list[dict[str, Any]]:
    """Each set of hyperparameters logged (one per ``log_hyperparams``), in order: TensorBoard shows the first.

    Raises:
        EventFileError: if a record is not an ``Event``.
    """
    return [
        _session_start_hparams(content)
        for _, tag, plugin, content, _ in _values(path)
        if plugin == "hparams" and tag.endswith("session_start_info")
    ]


def read_event_file(path: Path) -> tuple[dict[str, Any], list[tuple[int, str, str]]]:
    """The hyperparameters (merged in the order logged) and the texts ``(step, tag, text)`` of one event file.

    A text's tag is the one given to ``add_text`` (the writers' ``/text_summary`` suffix taken off).

    Raises:
        EventFileError: if a record is not an ``Event``.
    """
    hparams: dict[str, Any] = {}
    texts: list[tuple[int, str, str]] = []
    for step, tag, plugin, content, strings in _values(path):
        if plugin == "hparams" and tag.endswith("session_start_info"):
            hparams.update(_session_start_hparams(content))
        elif strings and tag.endswith("/text_summary"):
            texts.append((step, tag[: -len("/text_summary")], strings[0]))
    return hparams, texts


__all__ = ["EventFileError", "fields", "read_event_file", "records", "session_hparams"]
