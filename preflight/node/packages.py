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
    requires = dict((name, requirements(folders[name])) for name in REQUIRING if name in folders)
    return {"versions": versions, "distributions": dists, "requires": requires}


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


def torch_cuda_build():
    """torch.version.cuda, read from torch/version.py without importing torch."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, "version.py")
        if os.path.isfile(path):
            for line in open(path, encoding="utf-8"):
                if line.startswith("cuda"):
                    value = line.split("=", 1)[1].strip().strip("'\"")
                    return None if value == "None" else value
    return None
