"""The installed distributions and their versions, read from package metadata as importlib.metadata finds it,
never by importing a package (torch costs seconds)."""
import os
import re
import stat
import sys

KEY_DISTRIBUTIONS = ("torch", "deepspeed", "accelerate", "transformers")
NCCL_DISTRIBUTIONS = ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11")
# The training stack whose declared requirements (Requires-Dist) the head judges against what is installed.
REQUIRING = KEY_DISTRIBUTIONS + ("peft", "trl", "flash-attn", "bitsandbytes")


def facts():
    dists, folders, nccl = {}, {}, {}
    for folder in installed_distributions():
        name, version = name_and_version(folder)
        name = name.lower().replace("_", "-")
        if name and name not in dists:
            dists[name] = version
            folders[name] = folder
        if name in NCCL_DISTRIBUTIONS and version and name not in nccl:
            nccl[name] = version  # a copy whose metadata has no Version does not hide one that has
    versions = {name: dists.get(name) for name in KEY_DISTRIBUTIONS}
    versions["cuda"] = torch_cuda_build()
    versions["nccl"] = next((nccl[n] for n in NCCL_DISTRIBUTIONS if n in nccl), None)
    loaded = torch_loaded_nccl() if versions["nccl"] is None and versions["cuda"] else None
    if loaded:
        versions["nccl"] = loaded[0]
    requires = dict((name, requirements(folders[name])) for name in REQUIRING if name in folders)
    return {"versions": versions, "distributions": dists, "requires": requires,
            "nccl_library": loaded[1] if loaded else None}


DIST_NAME_RUN = re.compile(r"[-_.]+")
DIST_FILE_BYTES = 1 << 20  # more than any METADATA header or entry_points.txt a package ships


def installed_distributions():
    """The metadata folder of each installed distribution (.dist-info, .egg-info) in sys.path order: the walk of
    importlib.metadata.distributions(), without its import and its pathlib per file (40 ms less for every
    `preflight node` in an environment with torch and DeepSpeed)."""
    for entry in sys.path:
        try:
            names = sorted(n for n in os.listdir(entry or ".") if n.endswith((".dist-info", ".egg-info")))
        except (OSError, TypeError, ValueError):  # a missing folder, a zip, a NUL in a name
            continue
        for name in names:
            yield os.path.join(entry or ".", name)


def distribution_key(folder):
    """A metadata folder's distribution name as importlib.metadata compares them (from the folder's name)."""
    return DIST_NAME_RUN.sub("_", os.path.basename(folder).rsplit(".", 1)[0].partition("-")[0]).lower()


def distribution_file(folder, name, limit=DIST_FILE_BYTES):
    """The text of file NAME of a distribution's metadata folder (a single-file .egg-info is its PKG-INFO), at most
    LIMIT bytes, or None. Opened without blocking and read only when it is a regular file with a size, so a FIFO,
    a device or a /proc file there (whatever it is swapped for) cannot stall the run."""
    path = folder if os.path.isfile(folder) and name == "PKG-INFO" else os.path.join(folder, name)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except (IOError, OSError):
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or not info.st_size:
            return None
        return os.read(fd, min(info.st_size, limit)).decode("utf-8", "replace")
    except (IOError, OSError):
        return None
    finally:
        os.close(fd)


def name_and_version(folder):
    """Name and Version from the metadata's header (the lines before the first blank one, at the top of the
    file): the e-mail parser only for a header these lines cannot read (folded)."""
    text = distribution_file(folder, "METADATA", 65536) or distribution_file(folder, "PKG-INFO", 65536) or ""
    head = text.split("\n\n", 1)[0]
    header = dict(line.split(": ", 1) for line in head.splitlines() if ": " in line)
    if "Name" in header and "Version" in header:
        return header["Name"].strip(), header["Version"].strip()
    from email.parser import HeaderParser

    parsed = HeaderParser().parsestr(head)
    return (parsed["Name"] or "").strip(), (parsed["Version"] or "").strip() or None


REQUIREMENT_NAME = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def requirements(folder):
    """The Requires-Dist lines of a distribution's metadata header (markers included) that name the training
    stack or torch's NCCL wheel: the others are not judged, and transformers alone declares some 250."""
    text = distribution_file(folder, "METADATA", 65536) or distribution_file(folder, "PKG-INFO", 65536) or ""
    found = []
    for line in text.split("\n\n", 1)[0].splitlines():
        if line.startswith("Requires-Dist:"):
            value = line.split(":", 1)[1].strip()
            name = REQUIREMENT_NAME.match(value)
            name = DIST_NAME_RUN.sub("-", name.group(1)).lower() if name else ""
            if name in REQUIRING or name.startswith("nvidia-nccl-"):
                found.append(value)
    return found


def torch_folders():
    import importlib.util

    spec = importlib.util.find_spec("torch")
    return list(spec.submodule_search_locations or []) if spec else []


def torch_cuda_build():
    """torch.version.cuda, read from torch/version.py without importing torch."""
    for folder in torch_folders():
        path = os.path.join(folder, "version.py")
        if os.path.isfile(path):
            for line in open(path, encoding="utf-8"):
                if line.startswith("cuda"):
                    value = line.split("=", 1)[1].strip().strip("'\"")
                    return None if value == "None" else value
    return None


SYSTEM_LIBRARY_FOLDERS = ("/usr/local/lib", "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64",
                          "/usr/lib", "/lib/x86_64-linux-gnu", "/lib/aarch64-linux-gnu", "/lib64", "/lib")


def torch_loaded_nccl():
    """The version of the libnccl a CUDA build of torch loads where no nvidia-nccl wheel brings it (NGC containers
    and conda build torch against a libnccl.so.2 of their own): only where libtorch_cuda.so names libnccl.so.2
    among its needed libraries (a torch that links NCCL into itself loads none), found where the dynamic loader
    looks (ld.so(8): DT_RPATH, LD_LIBRARY_PATH, DT_RUNPATH, then the system's folders in place of its cache),
    its version from the file the name resolves to (libnccl.so.2.20.3). (version, that file) or None where any of it
    is not known."""
    for folder in torch_folders():
        library = os.path.join(folder, "lib", "libtorch_cuda.so")
        dynamic = elf_dynamic(library)
        if dynamic is None:
            continue
        needed, rpath, runpath = dynamic
        name = next((n for n in needed if n.startswith("libnccl.so")), None)
        if name is None:
            return None
        origin = os.path.dirname(library)
        search = (rpath if not runpath else []) + [f for f in os.environ.get("LD_LIBRARY_PATH", "").split(":") if f]
        search = [f.replace("${ORIGIN}", origin).replace("$ORIGIN", origin) for f in search + runpath]
        for candidate in search + list(SYSTEM_LIBRARY_FOLDERS):
            path = os.path.join(candidate, name)
            if os.path.isfile(path):
                real = os.path.realpath(path)
                found = NAMED_RELEASE.match(os.path.basename(real))
                return (found.group(1), real) if found else None
        return None
    return None


LIBNCCL = re.compile(r"libnccl\.so[\d.]*$")  # NCCL itself, not a net plugin (libnccl-net*.so)
NAMED_RELEASE = re.compile(r"libnccl\.so\.(\d+\.\d+\.\d+)$")  # a system or conda NCCL names its version
WHEEL_LEVELS = 4  # site-packages/nvidia/nccl/lib/libnccl.so.2: the wheel's metadata is three folders up


def nccl_library_version(path, root="/"):
    """The version of the libnccl at `path`, proven from files alone (nothing is loaded or run), or None: the
    version its name gives (libnccl.so.2.21.5: a system or conda NCCL, as the dynamic loader resolves
    libnccl.so.2), else that of the nvidia-nccl wheel whose RECORD lists the file (site-packages/nvidia/nccl/lib/
    libnccl.so.2). A copy no such metadata owns (torch's own lib folder) is not known. `root`: the folder the
    path is in (/proc/PID/root for a process's own mount namespace)."""
    found = NAMED_RELEASE.match(os.path.basename(path))
    if found:
        return found.group(1)
    parts = path.strip("/").split("/")
    for up in range(1, min(WHEEL_LEVELS, len(parts)) + 1):
        folder, relative = os.path.join(root, *parts[:-up]), "/".join(parts[-up:])
        try:
            metadata = [n for n in os.listdir(folder) if n.lower().startswith("nvidia_nccl")
                        and n.endswith(".dist-info")]
        except (OSError, ValueError):
            continue
        for name in sorted(metadata):
            record = distribution_file(os.path.join(folder, name), "RECORD") or ""
            if any(line.split(",", 1)[0] == relative for line in record.splitlines()):
                return name_and_version(os.path.join(folder, name))[1]
    return None


ELF_READ_BYTES = 1 << 20  # the section headers and .dynamic of a shared object: far less


def elf_dynamic(path):
    """(DT_NEEDED names, DT_RPATH folders, DT_RUNPATH folders) of a 64-bit little-endian ELF shared object, read
    from its section headers, its .dynamic section and the strings they name (a few small reads, whatever the
    file's size, never loaded); None where the file is not one or cannot be read."""
    import struct

    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO put there cannot stall the run
        with os.fdopen(fd, "rb") as handle:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            head = handle.read(64)
            if len(head) < 64 or head[:4] != b"\x7fELF" or head[4:6] != b"\x02\x01":
                return None
            shoff = struct.unpack_from("<Q", head, 0x28)[0]
            entsize, count = struct.unpack_from("<HH", head, 0x3A)
            if entsize != 64 or count * 64 > ELF_READ_BYTES:
                return None
            handle.seek(shoff)
            table = handle.read(count * 64)
            sections = [struct.unpack_from("<IIQQQQIIQQ", table, i * 64) for i in range(len(table) // 64)]
            dynamic = next((sec for sec in sections if sec[1] == 6), None)  # SHT_DYNAMIC
            if dynamic is None or dynamic[6] >= len(sections) or dynamic[5] > ELF_READ_BYTES:
                return None
            strings_at = sections[dynamic[6]][4]  # sh_link: its string table
            handle.seek(dynamic[4])
            data = handle.read(dynamic[5])
            tags = {1: [], 15: [], 29: []}  # DT_NEEDED, DT_RPATH, DT_RUNPATH
            for tag, value in (struct.unpack_from("<qQ", data, i) for i in range(0, len(data) - 15, 16)):
                if tag == 0:  # DT_NULL
                    break
                if tag in tags and len(tags[tag]) < 256:
                    handle.seek(strings_at + value)
                    tags[tag].append(handle.read(4096).split(b"\0", 1)[0].decode("utf-8", "replace"))
    except (OSError, struct.error, OverflowError, ValueError):
        return None
    split = lambda values: [f for v in values for f in v.split(":") if f]  # noqa: E731
    return tags[1], split(tags[15]), split(tags[29])
