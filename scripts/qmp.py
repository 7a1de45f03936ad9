#!/usr/bin/env python3
"""Runs one QMP command on a QEMU's QMP socket and prints its reply (standard library only).

usage: scripts/qmp.py SOCKET COMMAND [ARGUMENTS-JSON]
  scripts/qmp.py /tmp/qmp.sock query-status
  scripts/qmp.py /tmp/qmp.sock migrate '{"uri": "unix:/tmp/migration.sock"}'
Prints the command's "return" value as JSON; on an error reply prints QEMU's error to stderr and
exits 1 (2 for bad arguments or an unreachable socket). Events QEMU sends meanwhile are skipped.
"""
import json
import socket
import sys


def main(argv):
    if len(argv) not in (3, 4):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    path, command = argv[1], argv[2]
    try:
        arguments = json.loads(argv[3]) if len(argv) == 4 else None
    except json.JSONDecodeError as e:
        print(f"qmp.py: the arguments are not JSON: {e}", file=sys.stderr)
        return 2
    if arguments is not None and not isinstance(arguments, dict):
        print("qmp.py: the arguments must be a JSON object", file=sys.stderr)
        return 2
    try:
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(30)
        s.connect(path)
    except OSError as e:
        print(f"qmp.py: cannot connect to {path}: {e}", file=sys.stderr)
        return 2
    f = s.makefile("rw")

    def reply(request):
        f.write(json.dumps(request) + "\n")
        f.flush()
        while True:
            line = f.readline()
            if not line:
                raise SystemExit(f"qmp.py: QEMU closed {path}")
            msg = json.loads(line)
            if "event" not in msg:
                return msg

    if "QMP" not in json.loads(f.readline() or "{}"):
        print(f"qmp.py: {path} did not greet with QMP", file=sys.stderr)
        return 2
    reply({"execute": "qmp_capabilities"})
    request = {"execute": command}
    if arguments is not None:
        request["arguments"] = arguments
    msg = reply(request)
    if "error" in msg:
        err = msg["error"]
        print(f"qmp.py: {command}: {err.get('class')}: {err.get('desc')}", file=sys.stderr)
        return 1
    print(json.dumps(msg.get("return")))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
