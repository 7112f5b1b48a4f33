"""The shared-folder probe, shipped to nodes like the collector (stdlib only).

mode "write" (on the head): write a file with a random token in the folder; "read" (on every other
node): read it back; "remove" (on the head): delete it. One JSON line each.
"""
import json
import os
import sys


def write(folder, name, token):
    path = os.path.join(folder, name)
    try:
        with open(path, "w") as handle:
            handle.write(token)
            handle.flush()
            os.fsync(handle.fileno())
        return {"ok": True, "path": path}
    except OSError as exc:
        return {"ok": False, "path": path, "error": exc.strerror or str(exc)}


def read(folder, name, token):
    path = os.path.join(folder, name)
    try:
        with open(path) as handle:
            found = handle.read()
    except OSError as exc:
        return {"ok": False, "path": path, "error": exc.strerror or str(exc)}
    return {"ok": found == token, "path": path, "error": None if found == token else "the file holds another token"}


def remove(folder, name):
    try:
        os.unlink(os.path.join(folder, name))
        return {"ok": True}
    except OSError as exc:
        return {"ok": False, "error": exc.strerror or str(exc)}


if __name__ == "__main__":
    options = globals().get("OPTIONS") or {}
    mode, folder, name = options.get("mode"), options.get("folder"), options.get("name")
    if mode == "write":
        answer = write(folder, name, options["token"])
    elif mode == "read":
        answer = read(folder, name, options["token"])
    else:
        answer = remove(folder, name)
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()
