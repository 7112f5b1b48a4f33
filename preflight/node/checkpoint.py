"""What a node sees of a checkpoint it is to resume from (preflight's CKPT facts), read as files, never loaded:
names and sizes, each torch file's zip central directory, each safetensors header, and the plain data of the
small pickles that say how the checkpoint was saved (preflight.node.pickled). The layouts are the libraries' own:
DeepSpeed's, as its engine names and loads the files (deepspeed/runtime/engine.py: _get_ckpt_name,
_get_rank_zero_ckpt_name, load_checkpoint); torch.distributed.checkpoint's (DCP: a `.metadata` that names each
data file and the bytes it holds); accelerate's save_state folder (checkpointing.save_accelerator_state) and the
HF Trainer's checkpoint-N (trainer.py _save_checkpoint), with the safetensors and torch files they write.
"""
import hashlib
import json
import os
import re
import stat
import struct
import zipfile

from preflight.node.pickled import Opaque, plain_data

PICKLE_BYTES = 16 << 20  # a model-states pickle without its tensors: kilobytes; past this it is not read
TAG_BYTES = 4096
LISTED = 4096  # a node names up to this many files of the tag; past it, their digest alone
ZERO_FILE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_?optim_states\.pt$")
ZERO3_MODEL_FILE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
# transformers' PREFIX_CHECKPOINT_DIR (trainer_utils) and accelerate's automatic_checkpoint_naming (checkpoints/)
NEWEST = re.compile(r"^checkpoint[-_](\d+)$")
MODEL_FILE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
# a pipeline's layers, each loaded by the stage that holds it (runtime/pipe/module.py: ckpt_layer_path; with
# tensor slicing the rank's coordinates follow the index: layer_03-model_01-model_states.pt)
LAYER_FILE = re.compile(r"^layer_\d+(?:-[\w-]+)?-model_states\.pt$")
# the random states each process saves and loads by its own index (accelerate: random_states_I.pkl; the
# Trainer: rng_state_I.pth, or rng_state.pth saved by one process)
RNG_FILE = re.compile(r"^(?:random_states_(\d+)\.pkl|rng_state(?:_(\d+))?\.pth)$")
SAFETENSORS_HEADER = 100000000  # safetensors refuses a longer header (MAX_HEADER_SIZE): HeaderTooLarge
JSON_BYTES = 16 << 20
ENTRIES = 65536  # a checkpoint folder holds a few files per rank; past this many entries it is not read further


def _regular(path):
    """os.stat of a regular file, else None (a FIFO or a device is never opened)."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info if stat.S_ISREG(info.st_mode) else None


def _not_there(path):
    """The facts of a file that is gone, or is not a regular file (a FIFO, a device, a folder: never opened)."""
    return {"bytes": None, "whole": "not a regular file" if os.path.lexists(path) else "missing"}


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
        return _not_there(path)
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


def read(path, universal=False, read=True, head_digest=None):
    """The facts of the checkpoint at `path`, whichever library saved it: a DeepSpeed root (with `latest`) or tag
    folder, a DCP folder, an accelerate save_state folder or a Trainer checkpoint-N. A folder of those (a Trainer's
    output folder, accelerate's project folder or its checkpoints/) resumes from its newest, as the libraries pick
    it ("picked"). universal: the job sets checkpoint.load_universal (DeepSpeed's tag then comes from
    `latest_universal`). read=False: names alone (what each node sees, one listing; the head reads the files
    once): their digest, and the names themselves, up to LISTED, only where the digest is not the head's
    (head_digest): a shared filesystem sends 16 characters a node."""
    picked = None if _deepspeed_root(path) else _newest(path)
    root = os.path.join(path, picked) if picked else path
    if _deepspeed_root(root) or _looks_like_tag(root) or _has_tag(root):
        facts = deepspeed(root, universal=universal, read=read, head_digest=head_digest)
    else:
        facts = saved_state(root, read=read, head_digest=head_digest)
    facts["picked"] = picked
    return facts


def _deepspeed_root(root):
    return any(os.path.lexists(os.path.join(root, name)) for name in ("latest", "latest_universal"))


def deepspeed(root, tag=None, universal=False, read=True, head_digest=None):
    """The facts of a DeepSpeed checkpoint: `root` is the folder save_checkpoint was given (with `latest`) or a
    tag folder itself; tag as load_checkpoint would be given one; the rest as read() says."""
    facts = {"path": root, "exists": os.path.isdir(root), "format": "deepspeed",
             "latest": _small_text(os.path.join(root, "latest")),
             "latest_universal": _small_text(os.path.join(root, "latest_universal"))}
    if tag is None and facts["latest"] is None and _looks_like_tag(root):
        root, tag = os.path.dirname(root.rstrip("/")) or ".", os.path.basename(root.rstrip("/"))
        facts["path"] = root
    facts["tag"] = tag or facts["latest_universal" if universal else "latest"]
    folder = os.path.join(root, facts["tag"]) if facts["tag"] else None
    names, facts["tag_exists"] = [], None
    if folder:
        try:
            names, facts["tag_exists"] = sorted(os.listdir(folder)), True
        except OSError:
            facts["tag_exists"] = False
    listed = [n for n in names if ZERO_FILE.match(n) or ZERO3_MODEL_FILE.match(n) or MODEL_FILE.match(n)
              or LAYER_FILE.match(n)]
    _listed(facts, listed, read, head_digest)
    facts["universal"] = bool(folder) and os.path.isdir(os.path.join(folder, "zero"))
    if not read:
        return facts
    # what the Trainer with DeepSpeed writes beside the tag (its checkpoint-N: the weights, trainer_state.json),
    # which the Trainer reads when it resumes without DeepSpeed
    facts["beside"] = _listing(root, subfolders=False)[:LISTED]
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


def _listed(facts, names, read, head_digest):
    """The names' count and digest (what the head and each node compare), and on a node (read=False) the names
    themselves where the digest is not the head's, and the room for the next save."""
    facts["count"], facts["digest"] = len(names), hashlib.sha256("\n".join(names).encode()).hexdigest()[:16]
    if not read:
        facts["names"] = names if len(names) <= LISTED and facts["digest"] != head_digest else None
        facts["room"] = _room(facts["path"])


def saved_state(root, read=True, head_digest=None):
    """The facts of a folder saved without DeepSpeed: "format" dcp (a `.metadata` and its data files), trainer
    (trainer_state.json, training_args.bin: the Trainer's checkpoint-N) or accelerate (random_states_I.pkl:
    save_state), else None. "files": each file's size and wholeness (its own subfolders of DCP data too, as
    accelerate's and the Trainer's FSDP saves write them: pytorch_model_fsdp_0/, optimizer_0/); "needs": the files
    another file names (a DCP `.metadata` each data file with the bytes it holds, a weights index each shard),
    {name: {"bytes": at least, "by": the naming file, "there": listed}}; "trainer_state": the step the Trainer
    resumes at."""
    names = _listing(root)
    facts = {"path": root, "exists": os.path.isdir(root), "format": _state_format(names), "tag": None}
    _listed(facts, names, read, head_digest)
    if not read:
        return facts
    files, needs, facts["trainer_state"], listed = {}, {}, None, set(names)
    for name in names[:LISTED]:
        found = _file(os.path.join(root, name))
        folder = os.path.dirname(name)
        for needed, (size, by) in found.pop("needs", {}).items():
            needed = os.path.join(folder, needed) if folder else needed
            needs[needed] = {"bytes": size, "by": name, "there": needed in listed}
        state = found.pop("json", None)
        if name == "trainer_state.json" and isinstance(state, dict):
            step = state.get("global_step")
            facts["trainer_state"] = {"global_step": step if isinstance(step, int) and not isinstance(step, bool)
                                      else None}
        files[name] = found
    facts["files"], facts["needs"] = files, needs
    return facts


def _listing(root, subfolders=True):
    """The regular files of root and of its subfolders (DCP data, a PEFT adapter each; subfolders=False: root's
    alone), as relative names, up to ENTRIES in all."""
    names, folders = [], []
    try:
        with os.scandir(root) as entries:
            for _, entry in zip(range(ENTRIES), entries):
                if entry.is_file(follow_symlinks=True):
                    names.append(entry.name)
                elif subfolders and entry.is_dir(follow_symlinks=False):
                    folders.append(entry.name)
        for folder in sorted(folders):
            with os.scandir(os.path.join(root, folder)) as inside:
                names.extend(os.path.join(folder, e.name) for _, e in zip(range(max(0, ENTRIES - len(names))), inside)
                             if e.is_file(follow_symlinks=True))
    except OSError:
        pass
    return sorted(names)


def _state_format(names):
    if ".metadata" in names:
        return "dcp"
    if "trainer_state.json" in names or "training_args.bin" in names:
        return "trainer"
    if any(RNG_FILE.match(n) and n.startswith("random_states_") for n in names):
        return "accelerate"
    return None


def _file(path):
    """{"bytes", "whole": True | why not | None (a format whose end cannot be checked)} of one saved file, with
    what it names ("needs") or says ("json")."""
    name = os.path.basename(path)
    if name.endswith(".safetensors"):
        return safetensors_file(path)
    info = _regular(path)
    if info is None:
        return _not_there(path)
    found = {"bytes": info.st_size, "whole": None}
    try:
        with open(path, "rb") as handle:
            magic = handle.read(4)
            if name.endswith(".json") and info.st_size <= JSON_BYTES:
                handle.seek(0)
                data = json.loads(handle.read().decode("utf-8"))
                found.update(whole=True, json=data)
                shards = data.get("weight_map") if isinstance(data, dict) else None
                if name.endswith(".index.json") and isinstance(shards, dict):  # a sharded model's index
                    found["needs"] = {shard: (1, name) for shard in set(shards.values()) if isinstance(shard, str)
                                      and "/" not in shard and shard not in ("", ".", "..")}
                return found
    except (OSError, ValueError) as exc:
        found["whole"] = "not whole (%s)" % (str(exc)[:200] or type(exc).__name__)
        return found
    if name == ".metadata":
        found.update(_dcp_metadata(path))
    elif magic == b"PK\x03\x04":
        found = torch_file(path)
    return found


def _dcp_metadata(path):
    """What a DCP `.metadata` says of the data files: {"whole", "needs": {file: (bytes it must hold, ".metadata")}}
    from its storage_data (each item's relative_path, offset and length: torch.distributed.checkpoint's
    filesystem._StorageInfo), read as plain data."""
    info = _regular(path)
    if info is None or info.st_size > PICKLE_BYTES:
        return {"whole": None}
    try:
        with open(path, "rb") as handle:
            data = plain_data(handle.read())
    except OSError as exc:
        return {"whole": "not readable (%s)" % (exc.strerror or type(exc).__name__)}
    state = data.state if isinstance(data, Opaque) and isinstance(data.state, dict) else None
    storage = state.get("storage_data") if state else None
    if not isinstance(storage, dict):  # another storage writer's, or a pickle this reader does not follow
        return {"whole": None}
    needs = {}
    for item in storage.values():
        where = item.state if isinstance(item, Opaque) and isinstance(item.state, dict) else {}
        name, offset, length = where.get("relative_path"), where.get("offset"), where.get("length")
        if isinstance(name, str) and "/" not in name and all(isinstance(v, int) for v in (offset, length)):
            needs[name] = (max(offset + length, needs.get(name, (0,))[0]), ".metadata")
    return {"whole": True, "needs": needs}


def safetensors_file(path):
    """{"bytes", "whole"} of a safetensors file: its header (8 bytes of length, then JSON) parses, and every
    tensor's data_offsets end within the file (a copy cut short does not)."""
    info = _regular(path)
    if info is None:
        return _not_there(path)
    found = {"bytes": info.st_size, "whole": True}
    try:
        with open(path, "rb") as handle:
            head = handle.read(8)
            if len(head) < 8:
                found["whole"] = "%d bytes: shorter than a safetensors header" % info.st_size
                return found
            (length,) = struct.unpack("<Q", head)
            if length > SAFETENSORS_HEADER or 8 + length > info.st_size:
                found["whole"] = ("a header of %d bytes, which safetensors refuses (HeaderTooLarge)" % length
                                  if length > SAFETENSORS_HEADER else "its header runs past the end of the file")
                return found
            header = json.loads(handle.read(length).decode("utf-8"))
    except (OSError, ValueError) as exc:
        found["whole"] = "not a safetensors file (%s)" % (str(exc)[:200] or type(exc).__name__)
        return found
    ends = [t["data_offsets"][1] for key, t in header.items() if key != "__metadata__" and isinstance(t, dict)
            and isinstance(t.get("data_offsets"), list) and len(t["data_offsets"]) == 2
            and isinstance(t["data_offsets"][1], int)] if isinstance(header, dict) else []
    if not isinstance(header, dict):
        found["whole"] = "not a safetensors file (its header is not a JSON object)"
    elif ends and 8 + length + max(ends) > info.st_size:
        found["whole"] = "cut short: %d bytes, its tensors run to %d" % (info.st_size, 8 + length + max(ends))
    return found


def _room(root):
    """{"free_bytes", "writable"} of the filesystem that holds the checkpoint, where the next save goes."""
    try:
        info = os.statvfs(root)
    except OSError:
        return None
    return {"free_bytes": info.f_bavail * info.f_frsize, "writable": os.access(root, os.W_OK)}


def _newest(root):
    """The checkpoint root resumes from, where it holds several: the checkpoint-N with the largest N (the HF
    Trainer's trainer_utils.get_last_checkpoint, for resume_from_checkpoint=True and its example scripts; with
    DeepSpeed each is a DeepSpeed root), or accelerate's checkpoint_N, in root or in its checkpoints/ (load_state()
    with automatic_checkpoint_naming); None where root holds none."""
    for folder in ("", "checkpoints"):
        try:
            with os.scandir(os.path.join(root, folder)) as entries:
                found = [(int(m.group(1)), entry.name) for _, entry in zip(range(ENTRIES), entries)
                         for m in [NEWEST.match(entry.name)] if m and entry.is_dir()]
        except OSError:
            continue
        if found:
            return os.path.join(folder, max(found)[1]) if folder else max(found)[1]
    return None


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
    optimizer = config.get("optimizer") if isinstance(config.get("optimizer"), dict) else {}
    return {"optimizer": optimizer["type"].lower() if isinstance(optimizer.get("type"), str) else None,
            "dp_world_size": number("dp_world_size"), "mp_world_size": number("mp_world_size"),
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
