"""One line and exit status 2 for bad input to the tools in tools/, instead of a traceback.

    import tool_errors
    if __name__ == "__main__":
        tool_errors.run(main, "trace_svg")

run() calls main() and turns what a bad path or a bad file raises (a file that cannot be read or
written, a directory that does not exist, JSON that does not parse, a file without the keys a tool
reads) into "<tool>: error: <what>, <path>" on stderr and exit status 2. fail() is the same line
for a tool's own checks.
"""
import json
import sys


class BadInput(Exception):
    """Raised by a tool for input it cannot use; run() prints it as one line."""


def fail(message):
    raise BadInput(message)


def run(main, prog):
    try:
        status = main()
    except BadInput as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:
        where = f": {e.filename}" if e.filename else ""
        print(f"{prog}: error: {e.strerror or e}{where}", file=sys.stderr)
        sys.exit(2)
    except json.JSONDecodeError as e:
        print(f"{prog}: error: not JSON ({e})", file=sys.stderr)
        sys.exit(2)
    except (KeyError, TypeError) as e:
        print(f"{prog}: error: the input lacks what {prog} reads (missing {e})", file=sys.stderr)
        sys.exit(2)
    sys.exit(status or 0)
