"""What this node's launch would read: its accelerate config, the files its command line names, and where its
programs resolve, as a session on the node sees them. A file is read only when it is regular, without blocking
(never a FIFO or a device), and within limits; what comes back is its digest, and its text when small."""
import hashlib
import os
import stat
import time

TEXT_LIMIT = 1 << 20  # a config file's text comes back up to this size; bigger files only as a digest
DIGEST_LIMIT = 256 << 20  # past this, a file is not read at all (a checkpoint named on the command line)


def facts(job):
    """What this node's launch would read, as its SSH session sees it: the accelerate config (the one
    named, else accelerate's default under this session's HF_HOME / XDG_CACHE_HOME), the files of the
    command line, and where the launcher and python resolve on this session's PATH. None: not asked.
    With "expand", $VAR in the command is this session's variable, as a shell on the node reads it."""
    if not job:
        return None
    cwd = job.get("cwd") or os.getcwd()

    def word(text):
        return os.path.expandvars(text) if job.get("expand") else text

    config = job.get("config")
    if config:
        config_file = read_file(word(config), cwd, True)
    elif job.get("default_config", True):
        env = dict(os.environ, **(job.get("env") or {}))  # `HF_HOME=/x accelerate launch ...` sets it for the launch
        config_file = dict(read_file(accelerate_default_config(env), cwd, True), default=True)
    else:
        config_file = None
    # Digests within a deadline: data files on a shared filesystem, read by every node at once, must not
    # hold back the facts past the run's timeout.
    until = time.monotonic() + float(job.get("deadline_s") or 5)
    files = {}
    for name in job.get("files") or ():
        if time.monotonic() > until:
            files[name] = {"path": name, "error": "not read: out of time (the run's deadline)"}
        else:
            files[name] = read_file(word(name), cwd, name in (job.get("text") or ()))
    return {
        "cwd": cwd, "cwd_exists": os.path.isdir(cwd), "argv": [word(a) for a in job.get("argv") or ()],
        "config": config_file, "files": files,
        "programs": dict((name, _program(word(name), cwd)) for name in job.get("programs") or ()),
    }


def accelerate_default_config(env=None):
    """accelerate's default config file (accelerate/commands/config/config_args.py): the YAML one,
    unless only the JSON one exists. `env`: the launch's environment (default: this process's)."""
    env = os.environ if env is None else env
    cache = env.get("XDG_CACHE_HOME") or os.path.join(env.get("HOME") or os.path.expanduser("~"), ".cache")
    home = os.path.expanduser(env.get("HF_HOME") or os.path.join(cache, "huggingface"))
    yaml_file = os.path.join(home, "accelerate", "default_config.yaml")
    json_file = os.path.join(home, "accelerate", "default_config.json")
    return yaml_file if os.path.isfile(yaml_file) or not os.path.isfile(json_file) else json_file


def read_file(path, cwd, text=False):
    """{"path", "sha256", "size"} of a regular file (relative: to the job's working directory), with its
    "text" when asked and small; {"path", "error"} otherwise. Never opens a FIFO or a device."""
    full = os.path.normpath(os.path.join(cwd, os.path.expanduser(path)))
    entry = {"path": full}
    try:
        st = os.stat(full)
        if not stat.S_ISREG(st.st_mode):
            entry["error"] = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
            return entry
        entry["size"] = st.st_size
        if st.st_size > DIGEST_LIMIT:
            entry["error"] = "larger than %d MiB: not read" % (DIGEST_LIMIT >> 20)
            return entry
        digest, data, kept = hashlib.sha256(), [], 0
        fd = os.open(full, os.O_RDONLY | os.O_NONBLOCK)
        try:
            while True:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    break
                digest.update(chunk)
                if text and kept <= TEXT_LIMIT:
                    data.append(chunk)
                    kept += len(chunk)
        finally:
            os.close(fd)
    except OSError as exc:
        entry["error"] = "missing" if exc.errno == 2 else (exc.strerror or str(exc))
        return entry
    except ValueError:  # a NUL byte in the path: no file can have that name
        entry["error"] = "the path holds a NUL byte: no file has that name"
        return entry
    entry["sha256"] = digest.hexdigest()
    if text and kept <= TEXT_LIMIT:
        try:
            entry["text"] = b"".join(data).decode("utf-8-sig")
        except UnicodeDecodeError:
            entry["error"] = "not UTF-8 text"
    return entry


def _program(name, cwd="."):
    """Where `name` resolves on this session's PATH (a name with a / from the job's working directory, as
    the launch's shell would), and the interpreter its #! line runs."""
    import shutil

    if name and "/" in name:
        path = os.path.join(cwd, name)
        path = path if os.path.isfile(path) and os.access(path, os.X_OK) else None
    else:
        path = shutil.which(name) if name else None
    if path is None:
        return {"name": name, "path": None}
    entry = {"name": name, "path": path, "real": os.path.realpath(path), "interpreter": None}
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return entry
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # never wait on a FIFO that looks like a program
        try:
            lines = os.read(fd, 1024).split(b"\n")
        finally:
            os.close(fd)
    except OSError:
        return entry
    words = lines[0][2:].decode("utf-8", "replace").split() if lines[0].startswith(b"#!") else []
    if words and os.path.basename(words[0]) == "env" and len(words) > 1:
        words = [shutil.which(words[-1]) or words[-1]]
    if words and os.path.basename(words[0]) == "sh" and len(lines) > 1 and lines[1].startswith(b"'''exec' "):
        words = [lines[1].split()[1].decode("utf-8", "replace")]  # pip's launcher for long interpreter paths
    entry["interpreter"] = words[0] if words else None
    return entry


