"""What this node's launch would read: its accelerate config, the files its command line names, and where its
programs resolve, as a session on the node sees them. A file is read only when it is regular, without blocking
(never a FIFO or a device), and within limits; what comes back is its digest, and its text when small."""
import hashlib
import json
import os
import re
import stat
import time

from preflight.node.paths import resolve

TEXT_LIMIT = 1 << 20  # a config file's text comes back up to this size; bigger files only as a digest
DIGEST_LIMIT = 256 << 20  # past this, a file is not read at all (a checkpoint named on the command line)
READ_S = 10.0  # one file's read stops here (a file on a hung filesystem, or one that never ends)


def facts(job):
    """What this node's launch would read, as its SSH session sees it: the accelerate config (the one
    named, else accelerate's default under this session's HF_HOME / XDG_CACHE_HOME), the files of the
    command line, and where the launcher and python resolve on this session's PATH. None: not asked.
    With "expand", $VAR in the command is this session's variable, as a shell on the node reads it, but for
    the names in "keep" in the command's words: the head fills those in (a SLURM step's per-task variables,
    which this session's step has for itself, not for the job's)."""
    if not job:
        return None
    cwd = job.get("cwd") or os.getcwd()
    keep = set(job.get("keep") or ())
    session = dict((k, v) for k, v in os.environ.items() if k not in keep)

    def word(text, environ=os.environ):
        return expand(text, environ) if job.get("expand") else text

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
            files[name] = read_file(word(name), cwd, name in (job.get("text") or ()), until)
    names = [word(name) for name in job.get("resolve") or ()] + [_main_process_ip(config_file)]
    resume, seen = job.get("resume") if isinstance(job.get("resume"), dict) else {}, None
    if isinstance(resume.get("path"), str):  # names alone: the head reads the files once
        from preflight.node import checkpoint  # zipfile and pickletools: only for a job that resumes

        seen = checkpoint.read(os.path.join(cwd, word(resume["path"])), read=False,
                               universal=resume.get("universal") is True, head_digest=resume.get("digest"))
    return {
        "cwd": cwd, "cwd_exists": os.path.isdir(cwd), "argv": [word(a, session) for a in job.get("argv") or ()],
        "config": config_file, "files": files,
        "programs": dict((name, _program(word(name), cwd)) for name in job.get("programs") or ()),
        "resolved": resolve(names), "checkpoint": seen,
        "deepspeed_env": deepspeed_env_files(cwd, dict(os.environ, **(job.get("env") or {}))),
    }


def deepspeed_env_files(cwd, env):
    """The .deepspeed_env files DeepSpeed's runner would read on this node: its name (DS_ENV_FILE) in the home
    folder and in the folder it starts in (launcher/runner.py, DEEPSPEED_ENVIRONMENT_PATHS), each file once."""
    name = env.get("DS_ENV_FILE") or ".deepspeed_env"
    found = []
    for folder in (os.path.expanduser("~"), cwd):
        path = os.path.realpath(os.path.join(folder, name))
        if os.path.isfile(path) and path not in found:
            found.append(path)
    return found


VARIABLE = re.compile(r"\$(\w+|\{[^}]*\})", re.ASCII)  # posixpath.expandvars' own pattern


def expand(text, environ):
    """$NAME and ${NAME} in `text` from `environ`, as os.path.expandvars reads them from os.environ (posixpath's
    expandvars): a name that is not there is left as it is."""
    def value(match):
        name = match.group(1)
        name = name[1:-1] if name.startswith("{") and name.endswith("}") else name
        return environ[name] if name in environ else match.group(0)

    return VARIABLE.sub(value, text) if "$" in text else text


def _main_process_ip(config_file):
    """The main_process_ip of this node's accelerate config, to be resolved here: the head parses the config
    (this is a scan of its top level, JSON by the name as accelerate's load_config_from_file picks, else YAML
    `main_process_ip: NAME`); a name it misses is compared as written there."""
    text = (config_file or {}).get("text")
    if not isinstance(text, str):
        return None
    if config_file["path"].endswith(".json"):
        try:
            value = json.loads(text).get("main_process_ip")
        except (ValueError, AttributeError, RecursionError):
            return None
        return value if isinstance(value, str) else None
    found = re.search(r"^main_process_ip[ \t]*:[ \t]*(['\"]?)([^'\"#\s]+)\1[ \t]*(#.*)?$", text, re.M)
    return found.group(2) if found and found.group(2) not in ("null", "Null", "NULL", "~") else None


def accelerate_default_config(env=None):
    """accelerate's default config file (accelerate/commands/config/config_args.py): the YAML one,
    unless only the JSON one exists. `env`: the launch's environment (default: this process's)."""
    env = os.environ if env is None else env
    cache = env.get("XDG_CACHE_HOME") or os.path.join(env.get("HOME") or os.path.expanduser("~"), ".cache")
    home = os.path.expanduser(env.get("HF_HOME") or os.path.join(cache, "huggingface"))
    yaml_file = os.path.join(home, "accelerate", "default_config.yaml")
    json_file = os.path.join(home, "accelerate", "default_config.json")
    return yaml_file if os.path.isfile(yaml_file) or not os.path.isfile(json_file) else json_file


def read_file(path, cwd, text=False, until=None):
    """{"path", "sha256", "size"} of a regular file (relative: to the job's working directory), with its
    "text" when asked and small; {"path", "error"} otherwise. Never reads a FIFO or a device, even when the
    path (a symlink) changes between the stat and the open; stops at DIGEST_LIMIT bytes and at `until`
    (time.monotonic()), else READ_S from now."""
    full = os.path.normpath(os.path.join(cwd, os.path.expanduser(path)))
    entry = {"path": full}
    until = min(until or float("inf"), time.monotonic() + READ_S)
    try:
        st = os.stat(full)  # first, so that a device is not even opened when the path names one
        if stat.S_ISREG(st.st_mode):
            entry["size"] = st.st_size
        problem = _not_readable(st)
        if problem:
            entry["error"] = problem
            return entry
        digest, data, kept, size = hashlib.sha256(), [], 0, 0
        fd = open_regular(full)
        try:
            entry["size"] = os.fstat(fd).st_size
            while True:
                if size > DIGEST_LIMIT:  # it grew past the limit while read
                    entry["error"] = "larger than %d MiB: not read" % (DIGEST_LIMIT >> 20)
                    return entry
                if time.monotonic() > until:
                    entry["error"] = "not read to its end: out of time (the run's deadline, at most %g s a file)" % READ_S
                    return entry
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    break
                size += len(chunk)
                digest.update(chunk)
                if text and kept <= TEXT_LIMIT:
                    data.append(chunk)
                    kept += len(chunk)
        finally:
            os.close(fd)
    except NotRegular as exc:
        entry["error"] = str(exc)
        return entry
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


class NotRegular(Exception):
    """The opened file is not a regular file of a size that is read (the path changed after its stat)."""


def _not_readable(st):
    """Why a file with this stat is not read (None: it is read)."""
    if stat.S_ISDIR(st.st_mode):
        return "a directory"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_size > DIGEST_LIMIT:
        return "larger than %d MiB: not read" % (DIGEST_LIMIT >> 20)
    return None


def open_regular(path):
    """A read-only descriptor of the regular file at `path`, checked on the descriptor itself (fstat), so a
    symlink flipped to /dev/zero or a FIFO after a stat is refused (NotRegular), never read. O_NONBLOCK: an
    open that meets a FIFO returns at once; O_NOCTTY: a terminal never becomes this process's."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        problem = _not_readable(os.fstat(fd))
    except OSError:
        os.close(fd)
        raise
    if problem:
        os.close(fd)
        raise NotRegular(problem)
    return fd


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
        fd = open_regular(path)  # never wait on a FIFO that looks like a program
        try:
            lines = os.read(fd, 1024).split(b"\n")
        finally:
            os.close(fd)
    except (OSError, NotRegular):
        return entry
    words = lines[0][2:].decode("utf-8", "replace").split() if lines[0].startswith(b"#!") else []
    if words and os.path.basename(words[0]) == "env" and len(words) > 1:
        words = [shutil.which(words[-1]) or words[-1]]
    if words and os.path.basename(words[0]) == "sh" and len(lines) > 1 and lines[1].startswith(b"'''exec' "):
        words = [lines[1].split()[1].decode("utf-8", "replace")]  # pip's launcher for long interpreter paths
    entry["interpreter"] = words[0] if words else None
    return entry


