"""Plain data across the sandbox boundary: a strict codec and length-prefixed JSON frames.

Both sides use this file: the trusted judge imports it, and its source is sent into the sandboxed
child (``python -I -S``), so it imports only the standard library, and only what is cheap to start
(no ``json``, whose import costs a program start ~25 ms): the judge's frames to the child are
``marshal`` (the child only reads data from the trusted side that way), the child's frames to the
judge are JSON written by ``dump_json`` and read by the judge with the C JSON scanner; it never
unmarshals anything from the child. What the child sends is decoded by ``decode``, which builds only plain data -- None, bool, int, float, complex, str, bytes,
bytearray and list / tuple / set / frozenset / dict / range of those (and an iterator over a list:
a function may return a generator) -- within bounds on size, nesting and item count (a range counts
as many items as it holds). Anything
else is a ``WireError``: the judge then fails the run. Nothing the child sends is ever executed,
unpickled or given methods of its own (exact types only, so no ``__eq__`` of the program's).
"""

import marshal
import os

try:
    from _json import encode_basestring_ascii as _quote
except ImportError:  # pragma: no cover - CPython always has the accelerator
    from json.encoder import encode_basestring_ascii as _quote

MAX_FRAME = 4 << 20  # bytes of JSON per message
MAX_DEPTH = 64
MAX_ITEMS = 1 << 18
MAX_INT_HEX = 4096  # about 4900 decimal digits, like CPython's own int/str conversion limit
_SMALL_INT = 1 << 53  # larger ints travel as hex, out of reach of JSON readers' digit limits
HEADER_SIZE = 4


class WireError(Exception):
    """A frame or a value that is not plain data within the bounds."""


def encode(value, callback=None):
    """``value`` as a JSON-able tree; a callable becomes ``{"cb": callback(fn)}`` if ``callback``."""
    budget = [MAX_ITEMS]

    def enc(v, depth):
        budget[0] -= 1
        if depth > MAX_DEPTH or budget[0] < 0:
            raise WireError("nested deeper than %d or more than %d items" % (MAX_DEPTH, MAX_ITEMS))
        kind = type(v)
        if v is None or kind is bool or kind is str or kind is float:
            return v
        if kind is int:
            return v if -_SMALL_INT < v < _SMALL_INT else {"i": hex(v)}
        if kind is list:
            return [enc(x, depth + 1) for x in v]
        if kind in _CONTAINER_TAGS:
            return {_CONTAINER_TAGS[kind]: [enc(x, depth + 1) for x in v]}
        if kind is dict:
            return {"d": [[enc(k, depth + 1), enc(x, depth + 1)] for k, x in v.items()]}
        if kind is bytes or kind is bytearray:
            return {"b" if kind is bytes else "ba": v.hex()}
        if kind is complex:
            return {"c": [v.real, v.imag]}
        if kind is range:
            return {"r": [enc(v.start, depth + 1), enc(v.stop, depth + 1), enc(v.step, depth + 1)]}
        if callback is not None and callable(v):
            return {"cb": callback(v)}
        if hasattr(kind, "__next__") and hasattr(kind, "__iter__"):  # generators, map, zip, ...
            items = []
            for x in v:
                items.append(enc(x, depth + 1))
            return {"it": items}
        raise WireError("not plain data: %s" % kind.__name__)

    return enc(value, 0)


_CONTAINER_TAGS = {tuple: "t", set: "s", frozenset: "f"}
_CONTAINERS = {"t": tuple, "s": set, "f": frozenset}


def decode(tree, callback=None):
    """The plain value of ``tree`` (as made by ``encode`` and parsed from JSON); ``WireError`` if not.

    ``callback(id)`` turns ``{"cb": id}`` into a callable; without it such a node is refused."""
    budget = [MAX_ITEMS]

    def dec(x, depth):
        budget[0] -= 1
        if depth > MAX_DEPTH or budget[0] < 0:
            raise WireError("nested deeper than %d or more than %d items" % (MAX_DEPTH, MAX_ITEMS))
        kind = type(x)
        if x is None or kind is bool or kind is str or kind is float or kind is int:
            return x
        if kind is list:
            return [dec(v, depth + 1) for v in x]
        if kind is not dict or len(x) != 1:
            raise WireError("not plain data: %s" % kind.__name__)
        (tag, v), = x.items()
        if tag == "i" and type(v) is str and len(v) <= MAX_INT_HEX:
            return int(v, 16)
        if tag in ("b", "ba") and type(v) is str:
            return (bytes if tag == "b" else bytearray).fromhex(v)
        if tag == "cb" and callback is not None and type(v) is int:
            return callback(v)
        if type(v) is not list:
            raise WireError("malformed %r node" % tag)
        if tag in _CONTAINERS:
            return _CONTAINERS[tag](dec(item, depth + 1) for item in v)
        if tag == "it":
            return iter([dec(item, depth + 1) for item in v])
        if tag == "d":
            if not all(type(pair) is list and len(pair) == 2 for pair in v):
                raise WireError("malformed dict node")
            return {dec(k, depth + 1): dec(item, depth + 1) for k, item in v}
        if tag == "c" and len(v) == 2 and all(type(p) in (float, int) for p in v):
            return complex(float(v[0]), float(v[1]))
        if tag == "r" and len(v) == 3:
            start, stop, step = (dec(p, depth + 1) for p in v)
            if type(start) is int and type(stop) is int and type(step) is int:
                made = range(start, stop, step)
                # three ints on the wire, but as many items as a list once the tests iterate it
                budget[0] -= (made[-1] - made[0]) // step + 1 if made else 0
                if budget[0] < 0:
                    raise WireError("a range over the %d-item bound" % MAX_ITEMS)
                return made
        raise WireError("malformed %r node" % tag)

    try:
        return dec(tree, 0)
    except WireError:
        raise
    except (TypeError, ValueError, OverflowError, RecursionError, MemoryError) as error:  # unhashable keys, bad hex
        raise WireError("malformed value: %s: %s" % (type(error).__name__, error)) from None


def framed(payload):
    if len(payload) > MAX_FRAME:
        raise WireError("message of %d bytes is over the %d-byte limit" % (len(payload), MAX_FRAME))
    return len(payload).to_bytes(HEADER_SIZE, "big") + payload


def pack_for_child(message):
    """A frame from the judge (trusted data of plain types) to the child."""
    return framed(marshal.dumps(message))


def pack(message):
    """A frame from the child to the judge: ``message`` (dicts, lists, str, int, float, bool, None) as JSON."""
    parts = []
    try:
        dump_json(message, parts.append, 0)
    except RecursionError:
        raise WireError("nested too deeply") from None
    return framed("".join(parts).encode("ascii"))


_FLOATS = {float("inf"): "Infinity", float("-inf"): "-Infinity"}


def dump_json(value, write, depth):
    kind = type(value)
    if depth > MAX_DEPTH + 8:
        raise WireError("nested too deeply")
    if value is None:
        write("null")
    elif kind is bool:
        write("true" if value else "false")
    elif kind is int:
        write(int.__repr__(value))
    elif kind is float:
        write("NaN" if value != value else _FLOATS.get(value) or float.__repr__(value))
    elif kind is str:
        write(_quote(value))
    elif kind is list:
        write("[")
        for index, item in enumerate(value):
            if index:
                write(",")
            dump_json(item, write, depth + 1)
        write("]")
    elif kind is dict:
        write("{")
        for index, (key, item) in enumerate(value.items()):
            if type(key) is not str:
                raise WireError("a JSON key must be a str")
            write("," if index else "")
            write(_quote(key))
            write(":")
            dump_json(item, write, depth + 1)
        write("}")
    else:
        raise WireError("cannot write a %s as JSON" % kind.__name__)


def frame_length(header):
    length = int.from_bytes(header, "big")
    if length > MAX_FRAME:
        raise WireError("frame of %d bytes is over the %d-byte limit" % (length, MAX_FRAME))
    return length


class _JsonSettings:
    """What the C JSON scanner reads: strict strings, no hooks (``json.loads``' defaults)."""
    strict = True
    object_hook = object_pairs_hook = None
    parse_float, parse_int = float, int
    parse_constant = staticmethod({"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}.__getitem__)


def _loads(text):
    """``json.loads(text)`` with the C scanner alone: importing ``json`` (``re``, ``enum``) costs a
    process start ~30 ms, and the judge's process parses every reply of the program."""
    try:
        from _json import make_scanner
    except ImportError:  # pragma: no cover - CPython always has the accelerator
        import json

        return json.loads(text)
    try:
        value, end = make_scanner(_JsonSettings())(text, 0)
    except StopIteration:
        raise ValueError("not JSON") from None
    except SystemError:
        # the C scanner reports a malformed object, array or string through json.decoder's
        # JSONDecodeError, which it looks up in sys.modules only: without json imported (never here:
        # importing it because of the program's bytes would change the tests' process) that lookup
        # fails and the scanner ends in SystemError. Either way the frame is not JSON.
        raise ValueError("not JSON") from None
    if end != len(text):
        raise ValueError("extra data after the JSON value")
    return value


def unpack(payload):
    """The message (a dict) in a frame from the child (the judge's side); ``WireError`` for anything else."""
    try:
        message = _loads(payload.decode("ascii"))
    except (ValueError, RecursionError, MemoryError) as error:
        raise WireError("not a JSON frame: %s" % type(error).__name__) from None
    if type(message) is not dict:
        raise WireError("a frame must hold a JSON object")
    return message


def write_frame(fd, message):
    """Blocking write of one frame to the judge (the child's side)."""
    write_all(fd, pack(message))


def write_all(fd, data):
    data = memoryview(data)
    while data:
        data = data[os.write(fd, data):]


def read_frame(fd):
    """Blocking read of one frame from the judge (the child's side: trusted marshal data); None at EOF."""
    header = read_exactly(fd, HEADER_SIZE)
    if header is None:
        return None
    payload = read_exactly(fd, frame_length(header))
    if payload is None:
        return None
    return marshal.loads(payload)


def read_exactly(fd, size):
    chunks, left = [], size
    while left:
        chunk = os.read(fd, min(left, 1 << 16))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
