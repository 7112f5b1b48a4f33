"""What a node sees of a checkpoint it is to resume from (preflight's CKPT facts), read as files, never loaded:
names and sizes, each torch file's zip central directory, and the plain data of the small pickles that say how
the checkpoint was saved (preflight.node.pickled). DeepSpeed's layout, as its engine names and loads the files
(deepspeed/runtime/engine.py: _get_ckpt_name, _get_rank_zero_ckpt_name, load_checkpoint)."""
import hashlib
import os
import re
import stat
import zipfile

from preflight.node.pickled import Opaque, plain_data

PICKLE_BYTES = 16 << 20  # a model-states pickle without its tensors: kilobytes; past this it is not read
TAG_BYTES = 4096
LISTED = 4096  # a node names up to this many files of the tag; past it, their digest alone
ZERO_FILE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_?optim_states\.pt$")
ZERO3_MODEL_FILE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
TRAINER_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")  # transformers' PREFIX_CHECKPOINT_DIR, trainer_utils
MODEL_FILE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")


def _regular(path):
    """os.stat of a regular file, else None (a FIFO or a device is never opened)."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info if stat.S_ISREG(info.st_mode) else None


def _small_text(path, limit=TAG_BYTES):
    if _regular(path) is None:
        return None
    try:
        with open(path, "rb") as handle:
            return handle.read(limit).decode("utf-8", "replace").strip()
    except OSError:
        return None


def torch_file(path, read_pickle=False):
    """{"bytes", "whole": True | the reason it is not, "data": plain data of its pickle (read_pickle)} of a file
    torch.save wrote (a zip: its central directory at the end is gone when a save was cut short)."""
    info = _regular(path)
    if info is None:
        return {"bytes": None, "whole": "not a regular file" if os.path.lexists(path) else "missing"}
    found = {"bytes": info.st_size, "whole": True}
    try:
        with zipfile.ZipFile(path) as archive:
            members = archive.infolist()
            for member in members:
                if member.header_offset + member.compress_size > info.st_size:
                    found["whole"] = "member %s runs past the end of the file" % member.filename
                    return found
            if read_pickle:
                pickles = [m for m in members if m.filename.endswith("/data.pkl") or m.filename == "data.pkl"]
                if pickles and pickles[0].file_size <= PICKLE_BYTES:
                    found["data"] = plain_data(archive.read(pickles[0]))
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        found["whole"] = "not a whole torch file (%s)" % (str(exc) or type(exc).__name__)
    return found


def deepspeed(root, tag=None, universal=False, read=True, head_digest=None):
    """The facts of a DeepSpeed checkpoint: `root` is the folder save_checkpoint was given (with `latest`) or a
    tag folder itself; tag as load_checkpoint would be given one; universal: the job sets checkpoint.load_universal
    (its tag then comes from `latest_universal`, as load_checkpoint reads it). read=False: names alone (what each
    node sees, one listing; the head reads the files once): their digest, and the names themselves, up to LISTED,
    only where the digest is not the head's (head_digest): a shared filesystem sends 16 characters a node."""
    newest = None if os.path.lexists(os.path.join(root, "latest")) else _newest_trainer_checkpoint(root)
    if newest is not None:  # a Trainer's output folder: it resumes from its newest checkpoint-N
        root = os.path.join(root, newest)
    facts = {"path": root, "exists": os.path.isdir(root), "format": "deepspeed",
             "latest": _small_text(os.path.join(root, "latest")),
             "latest_universal": _small_text(os.path.join(root, "latest_universal")), "trainer_checkpoint": newest}
    if tag is None and facts["latest"] is None and _looks_like_tag(root):
        root, tag = os.path.dirname(root.rstrip("/")) or ".", os.path.basename(root.rstrip("/"))
        facts["path"] = root
    elif tag is None and facts["latest"] is None and facts["latest_universal"] is None and not _has_tag(root):
        facts["format"] = None  # no DeepSpeed checkpoint here (another library's, or nothing)
    facts["tag"] = tag or facts["latest_universal" if universal else "latest"]
    folder = os.path.join(root, facts["tag"]) if facts["tag"] else None
    names, facts["tag_exists"] = [], None
    if folder:
        try:
            names, facts["tag_exists"] = sorted(os.listdir(folder)), True
        except OSError:
            facts["tag_exists"] = False
    listed = [n for n in names if ZERO_FILE.match(n) or ZERO3_MODEL_FILE.match(n) or MODEL_FILE.match(n)]
    facts["count"], facts["digest"] = len(listed), hashlib.sha256("\n".join(listed).encode()).hexdigest()[:16]
    facts["universal"] = bool(folder) and os.path.isdir(os.path.join(folder, "zero"))
    if not read:
        facts["names"] = listed if len(listed) <= LISTED and facts["digest"] != head_digest else None
        facts["room"] = _room(root)
        return facts
    files = {}
    for name in listed:
        zero3 = ZERO3_MODEL_FILE.match(name)
        # how it was saved: from the model states that rank 0 wrote (at stage 3 every rank writes its own)
        first = bool(MODEL_FILE.match(name)) or bool(zero3 and zero3.group(1) == "0")
        files[name] = torch_file(os.path.join(folder, name), read_pickle=first)
    facts["files"] = {name: {k: v for k, v in found.items() if k != "data"} for name, found in files.items()}
    saved = next((found.get("data") for name, found in sorted(files.items())
                  if isinstance(found.get("data"), dict)), None)
    facts["saved"] = _saved(saved) if saved else None
    return facts


def _room(root):
    """{"free_bytes", "writable"} of the filesystem that holds the checkpoint, where the next save goes."""
    try:
        info = os.statvfs(root)
    except OSError:
        return None
    return {"free_bytes": info.f_bavail * info.f_frsize, "writable": os.access(root, os.W_OK)}


def _newest_trainer_checkpoint(root):
    """The checkpoint-N with the largest N in root, as the HF Trainer picks it (trainer_utils.get_last_checkpoint,
    for resume_from_checkpoint=True and its example scripts), or None. A Trainer with DeepSpeed saves each one
    with the engine's save_checkpoint: a DeepSpeed root, with its `latest`."""
    try:
        with os.scandir(root) as entries:
            found = [(int(m.group(1)), entry.name) for entry in entries
                     for m in [TRAINER_CHECKPOINT.match(entry.name)] if m and entry.is_dir()]
    except OSError:
        return None
    return max(found)[1] if found else None


def _has_tag(root, folders=64):
    """A tag folder among the first `folders` folders of root (a checkpoint root holds a few; a bound for any other)."""
    try:
        with os.scandir(root) as entries:
            found = [entry.path for entry in entries if entry.is_dir(follow_symlinks=False)][:folders]
    except OSError:
        return False
    return any(_looks_like_tag(path) for path in found)


def _looks_like_tag(path):
    try:
        return any(ZERO_FILE.match(n) or MODEL_FILE.match(n) for n in os.listdir(path))
    except OSError:
        return False


def _saved(data):
    """How the checkpoint was saved, from the model states' plain data."""
    config = data.get("ds_config") if isinstance(data.get("ds_config"), dict) else {}
    zero = config.get("zero_optimization") if isinstance(config.get("zero_optimization"), dict) else {}
    precision = next((p for p in ("bf16", "fp16") if isinstance(config.get(p), dict) and config[p].get("enabled")),
                     "fp32")

    def number(key):
        value = data.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    stage = zero.get("stage")
    return {"dp_world_size": number("dp_world_size"), "mp_world_size": number("mp_world_size"),
            "pp_degree": _parallel(data, "pp_degree"), "tp_degree": _parallel(data, "tp_degree"),
            "zero_stage": stage if isinstance(stage, int) and not isinstance(stage, bool) else None,
            "precision": precision, "ds_version": data.get("ds_version") if isinstance(data.get("ds_version"), str)
            else None, "global_steps": number("global_steps"),
            # what ds_to_universal needs; without it the conversion asks for --inject_missing_state
            "universal_info": "universal_checkpoint_info" in data,
            # saved without ZeRO the optimizer is in the model states; with ZeRO in each rank's shard (None here)
            "optimizer_in_model_states": data.get("optimizer") is not None}


def _parallel(data, key):
    dims = data.get("checkpoint_parallel_dimensions")
    value = dims.get(key) if isinstance(dims, dict) else None
    return value if isinstance(value, int) and not isinstance(value, (bool, Opaque)) else None
