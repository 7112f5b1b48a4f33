"""NCCL's configuration files, read on the node as NCCL reads them (src/misc/param.cc of NVIDIA/nccl, initEnvFunc
and setEnvFile; src/include/param.h before 2.12.10): the file NCCL_CONF_FILE names (since 2.23) else
~/.nccl.conf, then /etc/nccl.conf. Every candidate is read here (the head knows which NCCL the node loads, and so
which of them NCCL reads: preflight.job.nccl.nccl_env). A file is read only when it is regular (never a FIFO or a
device), and only its first MAX_BYTES; only the NCCL_ lines come back."""
import errno
import os

from preflight.node.launchfiles import NotRegular, open_regular
from preflight.node.secret import REDACTED, secret_name

MAX_BYTES = 64 << 10  # NCCL reads a file whole; a larger one is read to here and said to be cut
MAX_ENTRIES = 128
PATH_MAX = 1023  # snprintf(confFilePath, 1024, ...)
FIELD_MAX = 1023  # setEnvFile's envVar[1024] and envValue[1024]: a name and a value are cut to 1,023 bytes
LINE_MAX = 4095  # since 2.30 setEnvFile reads with fgets(line, 4096): a longer line comes in pieces


def parse(data):
    """(entries, long lines) of a file's bytes as setEnvFile reads them: a line is split at its first `=`
    (no `=`: skipped) into the name and the value as written, spaces and quotes included (`NCCL_X = y` sets
    `NCCL_X `, not NCCL_X); each cut at 1,023 bytes and at a NUL byte; `#` lines are comments (since 2.26;
    before, `#NCCL_X=y` set `#NCCL_X`: either way not NCCL_X). Only the lines for an NCCL_ name are kept, those NCCL
    misreads too (`export NCCL_X=y`, ` NCCL_X=y`: their names as NCCL sets them, for the head to warn of).
    A value keeps a trailing CR: NCCL strips it only since 2.30 (the head decides). A line longer than 4,095
    bytes is not read here (NCCL 2.30 reads it in pieces, older ones whole): its number is in the second list."""
    entries, long_lines = [], []
    for number, line in enumerate(data.split(b"\n"), 1):
        if len(line) > LINE_MAX:
            long_lines.append(number)
            continue
        line = line.split(b"\0", 1)[0]  # NCCL's strlen, strchr and strncpy stop there
        name, equals, value = line.partition(b"=")
        bare = name.strip(b" \t")
        bare = bare[6:].lstrip(b" \t") if bare.startswith(b"export") else bare
        if not equals or not bare.startswith(b"NCCL_"):
            continue
        name = name[:FIELD_MAX].decode("utf-8", "replace")
        value = value[:FIELD_MAX].decode("utf-8", "replace")
        entries.append({"line": number, "name": name, "value": REDACTED if secret_name(bare.decode("utf-8", "replace"))
                        else value})
        if len(entries) >= MAX_ENTRIES:
            break
    return entries, long_lines


# Where NCCL's own fopen (or its first read) fails as ours did, NCCL reads nothing from the file and goes on
NOTHING_FOR_NCCL = frozenset((errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.ENAMETOOLONG, errno.EISDIR, errno.ENXIO))


def read_conf(path, same_user=True, at=None):
    """{"path", "entries", ...} of one file NCCL may read (opened at `at`, default `path`: a rank's own file
    through /proc/PID/root); {"path", "error", "nothing"} where it is not read:
    "nothing" true where NCCL reads nothing from it either (missing, a directory, a symlink loop; unreadable, when
    this is the user NCCL runs as; a socket), false where what NCCL reads is not known here (a FIFO, a device)."""
    entry = {"path": path}
    try:
        fd = open_regular(at or path)
        try:
            data = os.read(fd, MAX_BYTES + 1)
        finally:
            os.close(fd)
    except NotRegular as exc:
        entry.update(error=str(exc), nothing=str(exc) == "a directory")
        return entry
    except OSError as exc:
        entry.update(error="missing" if exc.errno == errno.ENOENT else (exc.strerror or str(exc)),
                     nothing=exc.errno in NOTHING_FOR_NCCL or (exc.errno == errno.EACCES and same_user))
        return entry
    except ValueError:  # a NUL byte in the path: no file has that name
        entry.update(error="missing", nothing=True)
        return entry
    if len(data) > MAX_BYTES:
        data, entry["cut_at"] = data[:MAX_BYTES], MAX_BYTES
    entry["entries"], long_lines = parse(data)
    if long_lines:
        entry["long_lines"] = long_lines[:16]
    return entry


def passwd_home(uid, root=None):
    """The home folder of this user in the password database (NCCL before 2.30: getpwuid(getuid())->pw_dir); in a
    container's own root (`root`, /proc/PID/root of another filesystem than this one's), its /etc/passwd."""
    if root is not None:
        try:
            fd = open_regular(root + "/etc/passwd")
            try:
                text = os.read(fd, 1 << 20).decode("utf-8", "replace")
            finally:
                os.close(fd)
        except (OSError, NotRegular):
            return None
        for line in text.splitlines():
            fields = line.split(":")
            if len(fields) >= 7 and fields[2] == str(uid):
                return fields[5]
        return None
    try:
        import pwd

        return pwd.getpwuid(uid).pw_dir
    except (ImportError, KeyError, OverflowError):
        return None


def facts(environ, uid=None, cwd=None, pid=None):
    """The configuration files NCCL may read in a process with this environment, run by `uid` (default: this
    one) in `cwd`: {"conf_file": NCCL_CONF_FILE, "home": HOME, "passwd_home", "files": {path: read_conf}}, the
    candidates in NCCL's order. `pid`: a running process's, whose files are read in its own filesystem (a
    container's: through /proc/PID/root, a relative path through /proc/PID/cwd) and its password database there
    where its root is not this one's."""
    same_user = uid is None or uid == os.geteuid()
    uid = os.getuid() if uid is None else uid
    conf = environ.get("NCCL_CONF_FILE") or None
    root = "/proc/%d/root" % pid if pid is not None else None
    home, pw_home = environ.get("HOME"), passwd_home(uid, root if root and not _same_root(root) else None)
    paths = [conf] + [os.path.join(h, ".nccl.conf") for h in (home, pw_home) if h] + ["/etc/nccl.conf"]
    files = {}
    for path in paths:
        if path and path[:PATH_MAX] not in files:
            path = path[:PATH_MAX]
            at = None if pid is None else root + path if path.startswith("/") else "/proc/%d/cwd/%s" % (pid, path)
            files[path] = read_conf(os.path.join(cwd or os.getcwd(), path), same_user, at)
    return {"conf_file": conf, "home": home, "passwd_home": pw_home, "files": files}


def _same_root(root):
    """Whether a process's root folder is this one's (not a container's own filesystem)."""
    try:
        there, here = os.stat(root), os.stat("/")
    except OSError:
        return True  # not known: this machine's password database, as before
    return (there.st_dev, there.st_ino) == (here.st_dev, here.st_ino)


FILE_VARIABLES = ("NCCL_CONF_FILE", "HOME")  # the variables that decide which files NCCL reads


def section(job):
    """The collector's section: the files NCCL would read in this node's launch (its environment over this
    session's: what its batch script exports, `NCCL_CONF_FILE=... accelerate launch`), as this user. The head
    sends job["nccl"]: {"env": the batch script's NCCL_CONF_FILE and HOME, "later": those it sets only when it
    runs}; both are echoed ("job_env", "later") for the head's merge (preflight.job.nccl.nccl_env)."""
    job = job if isinstance(job, dict) else {}
    told = job.get("nccl") if isinstance(job.get("nccl"), dict) else {}

    def variables(key):
        given = told.get(key) if isinstance(told.get(key), dict) else {}
        return dict((k, v) for k, v in given.items() if k in FILE_VARIABLES and isinstance(v, str))
    known, later = variables("env"), variables("later")
    environ = dict(os.environ, **known)
    environ.update(job.get("env") or {})  # the launch's own VAR=v words
    found = facts(environ, cwd=job.get("cwd"))
    if known:
        found["job_env"] = known
    if later:
        found["later"] = later
    return found


CONF_FILE_SINCE = (2, 23)  # NCCL_CONF_FILE, when set and not empty, is read instead of ~/.nccl.conf
HOME_ENV_SINCE = (2, 30)  # ~ is $HOME (before: getpwuid(getuid())->pw_dir), and a line's trailing CR is cut


# One release under each set of rules: NCCL_CONF_FILE ignored and the password database's home; NCCL_CONF_FILE
# read; $HOME and the CR cut. A release not known is judged by all three: what they agree on.
RULES = ((2, 22), CONF_FILE_SINCE, HOME_ENV_SINCE)


def merge(env, conf, release=None):
    """(values, sources, unread) of the variables NCCL reads in a process with environment `env` whose files
    the node read (`conf`: facts()), for the NCCL `release` (a tuple): `env` then, for each variable still unset,
    the NCCL_ lines of the file NCCL_CONF_FILE names (since 2.23; else ~/.nccl.conf: the password database's home
    before 2.30, $HOME since) and of /etc/nccl.conf, as initEnvFunc calls setEnvFile and it setenv(name, value,
    0): the environment wins over the files, the first file over the second, a file's first line for a name over
    its later ones. sources: name -> "PATH line N" of what a file set; unread: "PATH: why" of what NCCL reads that
    is not known here. With `release` None (not known), a variable the rules of NCCL's releases set differently
    is left out, and unread says so: never the newest NCCL's guess."""
    if release is not None:
        return _merge(env, conf, release)
    found = [_merge(env, conf, rules) for rules in RULES]
    values, sources, _ = found[-1]
    unread = list(dict.fromkeys(u for f in found for u in f[2]))
    for name in sorted(set().union(*(f[0] for f in found))):
        seen = [(f[0].get(name), f[1].get(name)) for f in found]
        if len(set(value for value, _ in seen)) > 1:
            values.pop(name, None)
            sources.pop(name, None)
            said = " or ".join(dict.fromkeys("%s=%s (%s)" % (name, v, w) if w else "%s unset" % name if v is None
                                             else "%s=%s" % (name, v) for v, w in seen))
            unread.append("%s: %s, by the NCCL release, which is not known here" % (name, said.replace("\r", "\\r")))
    return values, sources, tuple(unread)


def read_paths(env, conf, release=None):
    """([the paths of the files NCCL reads, in its order], why the first is not known or None), for the NCCL
    `release`; None: those every release reads."""
    if release is None:
        found = [read_paths(env, conf, rules) for rules in RULES]
        return [p for p in found[0][0] if all(p in f[0] for f in found)], next((f[1] for f in found if f[1]), None)
    recent = tuple(release[:2]) >= HOME_ENV_SINCE
    conf_file = env.get("NCCL_CONF_FILE") if tuple(release[:2]) >= CONF_FILE_SINCE else None
    home = (env.get("HOME") or conf.get("home")) if recent else conf.get("passwd_home")
    first = conf_file or ("%s/.nccl.conf" % home if home else None)
    later = conf.get("later") if isinstance(conf.get("later"), dict) else {}
    for name in ("NCCL_CONF_FILE",) * (tuple(release[:2]) >= CONF_FILE_SINCE) + ("HOME",) * (recent and not conf_file):
        if name in later:  # the batch script sets it when it runs: the file NCCL reads first is not known
            return ["/etc/nccl.conf"], ("%s: the job sets it when it runs (%s), so the file NCCL reads first is not "
                                        "known here" % (name, later[name]))
    return [p[:PATH_MAX] for p in (first, "/etc/nccl.conf") if p], None


def _merge(env, conf, release):
    files = conf.get("files") if isinstance(conf, dict) else None
    files = files if isinstance(files, dict) else {}
    recent = tuple(release[:2]) >= HOME_ENV_SINCE
    values, sources, unread = dict(env), {}, []
    paths, why = read_paths(env, conf, release)
    if why:
        unread.append(why)
    for path in paths:
        read = files.get(path)
        if not isinstance(read, dict):
            unread.append("%s: not read on the node (the job's own environment names it)" % path)
            continue
        if read.get("error") is not None and not read.get("nothing"):
            unread.append("%s: %s" % (path, read["error"]))
        if read.get("cut_at"):
            unread.append("%s: read to its first %d KiB only" % (path, read["cut_at"] >> 10))
        for number in read.get("long_lines") or ():
            unread.append("%s line %d: longer than 4,095 bytes (not read)" % (path, number))
        for entry in read.get("entries") or ():
            value = entry["value"][:-1] if recent and entry["value"].endswith("\r") else entry["value"]
            if entry["name"] not in values:
                values[entry["name"]] = value
                sources[entry["name"]] = "%s line %d" % (path, entry["line"])
    return values, sources, tuple(unread)
