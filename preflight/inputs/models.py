"""The model a memory estimate is for, and the sizes it is compared with: --model, --gpu-memory, --host-memory,
--seq-len (else the profile's [memory] table). The only I/O is reading a model's config.json: a file, a model
folder, or a model found in the local Hugging Face cache (never downloaded)."""
from __future__ import annotations

import glob
import os
import re
import stat
from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional, Tuple

from preflight.inputs import documents
from preflight.inputs.documents import InputError
from preflight.inputs.numbers import is_int, is_number

# A parameter count alone does not say how large the largest layer is (ZeRO-3 gathers one at a time on the
# GPU): 5% of the model, about the embedding of a 7-13B decoder with a 128k vocabulary.
LARGEST_LAYER_SHARE = 0.05

COUNT = re.compile(r"^\s*(\d+(?:\.\d+)?(?:e\d+)?)\s*([kmbt]?)\s*$", re.I)
COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}
SIZE = re.compile(r"^\s*(\d{1,20}(?:\.\d{1,20})?)\s*([kmgt]i?b?|b)?\s*$", re.I)
MAX_SIZE = 2 ** 50  # 1 PiB: no GPU or node has more; past it, the text is a typo
MAX_SEQ_LEN = 2 ** 24  # tokens per sample: 16M, far past any model's context
MAX_MICRO_BATCH = 2 ** 24


# --- the model's size -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Model:
    params: int
    largest_layer: int  # parameters of the largest module (its own, not its children's)
    source: str  # what was given: "7B", a path, a model id
    how: str  # how the count was made: "given", "from the config (llama)", "built on the meta device", ...
    estimated: bool = False  # True when the count (or the largest layer) is an estimate
    layers: Optional[int] = None  # for the activation margin
    hidden: Optional[int] = None
    experts: Optional[int] = None  # experts per MoE layer (1: a dense model); None: not known (a count was given)


MAX_PARAMS = 10 ** 15  # a thousand times the largest models trained: past it, the text is a typo, not a model
# The largest value of each shape field that a real model config holds, by orders of magnitude: a config
# past them (hidden_size 1e308, a million layers) is refused before any arithmetic or meta-device build.
SHAPE_LIMITS = {"hidden_size": 1 << 20, "n_embd": 1 << 20, "d_model": 1 << 20, "num_hidden_layers": 1 << 12,
                "n_layer": 1 << 12, "num_layers": 1 << 12, "intermediate_size": 1 << 23, "n_inner": 1 << 23,
                "vocab_size": 1 << 25, "n_positions": 1 << 24, "num_attention_heads": 1 << 14,
                "num_key_value_heads": 1 << 14, "head_dim": 1 << 16,
                # mixture-of-experts shapes (preflight.inputs.models._moe)
                "n_layers": 1 << 12, "n_heads": 1 << 14, "moe_intermediate_size": 1 << 23,
                "shared_expert_intermediate_size": 1 << 23, "num_local_experts": 1 << 16, "n_routed_experts": 1 << 16,
                "decoder_sparse_step": 1 << 12, "q_lora_rank": 1 << 20, "kv_lora_rank": 1 << 20,
                "qk_nope_head_dim": 1 << 16, "qk_rope_head_dim": 1 << 16, "v_head_dim": 1 << 16}


def parse_count(text: str) -> Optional[int]:
    """'7e9', '7B', '1.3b', '350M' -> a number of parameters; None when the text is no count."""
    match = COUNT.match(str(text))
    if not match:
        return None
    value = float(match.group(1)) * COUNT_UNITS[match.group(2).lower()]
    if not 1 <= value <= MAX_PARAMS:  # inf included
        return None
    return int(round(value))


def check_shapes(config: Mapping[str, Any]) -> None:
    """ValueError naming the first shape field of a config (or its text_config) that is no positive integer
    within SHAPE_LIMITS."""
    for part in (config, config.get("text_config")):
        if not isinstance(part, Mapping):
            continue
        for key, limit in SHAPE_LIMITS.items():
            value = part.get(key)
            if value is None:
                continue
            if not is_int(value) or not 1 <= value <= limit:
                raise ValueError(f"{key} is {value!r}; a model config holds a positive integer up to {limit} there")


def parse_size(text: Any, what: str) -> int:
    """A memory size -> bytes; ValueError naming `what` otherwise. Memory is sold in binary units (an "80GB"
    GPU has 80 GiB, NVML says 79.6 usable; a "512GB" node has 512 GiB of DIMMs), so K, M, G, T are KiB, MiB,
    GiB, TiB with or without the i, a bare number is GiB, and B alone is bytes."""
    if is_number(text):
        text = str(text)
    match = SIZE.match(text) if isinstance(text, str) and len(text) <= 64 else None
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"{what} {str(text)[:64]!r} is not a size such as 80GB (GiB, as memory is sold), 512G "
                         "or 85520809984B")
    unit = (match.group(2) or "g").lower()
    value = float(match.group(1)) * 2 ** (10 * "bkmgt".index(unit[0]))
    if value > MAX_SIZE:
        raise ValueError(f"{what} {text!r} is past 1 PiB: no GPU or node has that much memory")
    return int(value)


def hf_cache() -> str:
    """The Hugging Face hub cache, as huggingface_hub finds it."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def _mtime_if_regular(path: str) -> Optional[float]:
    """The file's mtime when it is a regular file (links followed); None for a FIFO, a device, a dangling link."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return st.st_mtime if stat.S_ISREG(st.st_mode) else None


def cached_config(model_id: str) -> Optional[str]:
    """config.json of `model_id` in the local cache: the snapshot refs/main names (a commit id, never a path),
    else the newest one. Only regular files: a FIFO would hang the read, a dangling link has no time."""
    folder = os.path.join(hf_cache(), "models--" + model_id.replace("/", "--"))
    ref = os.path.join(folder, "refs", "main")
    if _mtime_if_regular(ref) is not None:
        try:
            commit = documents.read_text(ref, "refs/main").strip()
        except InputError:
            commit = ""
        path = os.path.join(folder, "snapshots", commit, "config.json")
        if re.fullmatch(r"[0-9a-f]{40}", commit) and _mtime_if_regular(path) is not None:
            return path
    found = [(t, p) for p in glob.glob(os.path.join(glob.escape(folder), "snapshots", "*", "config.json"))
             for t in [_mtime_if_regular(p)] if t is not None]
    return max(found)[1] if found else None


def resolve(text: str, where: str = "--model") -> Model:
    """--model: a count, a config.json, a model folder or a cached model id; InputError (exit 2) otherwise."""
    text = str(text).strip()
    count = parse_count(text)
    if count is not None:
        return Model(count, int(count * LARGEST_LAYER_SHARE), text, "given", estimated=True)
    path = os.path.join(text, "config.json") if os.path.isdir(text) else text
    if os.path.exists(path) and not os.path.isfile(path):  # a FIFO would hang the read, a device never end
        raise InputError(path, "is not a regular file; --model takes a config.json, a model folder, a count or a "
                         "cached model id")
    if not os.path.isfile(path):
        path = cached_config(text) if re.match(r"^[\w.-]+(/[\w.-]+)?$", text) else None
        if path is None:
            raise InputError(where, f"{text!r} is no parameter count (7B, 7e9), no config.json or model folder, and "
                             f"no model in the local Hugging Face cache ({hf_cache()}); preflight never downloads")
    # The configs' reader: a size cap, nesting and digit limits, one line naming the file.
    config = dict(documents.load(path, "the model config", "json").data)
    try:
        params, largest, how, estimated = count_params(config)
    except (KeyError, TypeError, ValueError) as exc:
        raise InputError(path, f"cannot count the parameters: {exc}") from None
    text_config = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    layers, hidden = _shape(text_config)
    return Model(params, largest, text, how, estimated, layers, hidden, experts(text_config))


def experts(config: Mapping[str, Any]) -> int:
    """Experts per MoE layer as the config (or its family's defaults) gives them; 1 for a dense model."""
    defaults = MOE_DEFAULTS.get(config.get("model_type"), {})
    for key in EXPERT_COUNTS:
        for holder in (config, config.get("ffn_config") or {}, defaults):  # dbrx keeps them in ffn_config
            if isinstance(holder, Mapping) and is_int(holder.get(key)) and holder[key] > 0:
                return holder[key]
    return 2 if defaults else 1  # a MoE family whose count is its code's default


def _shape(config: Mapping[str, Any]) -> Tuple[Optional[int], Optional[int]]:
    layers = next((config[k] for k in ("num_hidden_layers", "n_layer", "num_layers") if isinstance(config.get(k), int)), None)
    hidden = next((config[k] for k in ("hidden_size", "n_embd", "d_model") if isinstance(config.get(k), int)), None)
    return layers, hidden


LLAMA_LIKE = ("llama", "mistral", "qwen2", "gemma2")


def count_params(config: Mapping[str, Any]) -> Tuple[int, int, str, bool]:
    """(parameters, largest layer, how, estimated) from a config: the architecture's own shapes for the
    common decoder families (equal to the model built on the meta device: tests/test_mem.py), else the model
    built on the meta device when transformers is installed, else 12·L·h² + V·h (an estimate)."""
    check_shapes(config)
    kind = config.get("model_type")
    if kind in LLAMA_LIKE:
        return (*_llama_like(config), f"from the config ({kind} shapes)", False)
    if kind == "gpt2":
        return (*_gpt2(config), "from the config (gpt2 shapes)", False)
    if kind in MOE_DEFAULTS:
        return (*_moe(config), f"from the config ({kind} shapes, every expert)", False)
    built = _on_meta_device(config)
    if built is not None:
        return (*built, "built on the meta device (transformers)", False)
    layers, hidden = _shape(config)
    vocab = config.get("vocab_size")
    if not (isinstance(layers, int) and isinstance(hidden, int) and isinstance(vocab, int)):
        raise ValueError(f"model_type {kind!r} is not one preflight knows, transformers is not installed, and the "
                         "config has no num_hidden_layers / hidden_size / vocab_size to estimate from")
    experts = next((config[k] for k in EXPERT_COUNTS if is_int(config.get(k)) and config[k] > 0), None)
    inter = next((config[k] for k in ("moe_intermediate_size", "intermediate_size") if is_int(config.get(k))), None)
    if experts and inter:  # memory holds every expert: attention 4·h², each expert's gated MLP 3·h·I
        return (layers * (4 * hidden ** 2 + experts * 3 * hidden * inter) + vocab * hidden,
                max(vocab * hidden, experts * 3 * hidden * inter), "estimated as L·(4·h² + E·3·h·I) + V·h", True)
    return 12 * layers * hidden ** 2 + vocab * hidden, vocab * hidden, "estimated as 12·L·h² + V·h", True


def _llama_like(c: Mapping[str, Any]) -> Tuple[int, int]:
    h, layers, inter, vocab = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"], c["vocab_size"]
    heads = c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or h // heads
    q, k = heads * head_dim, kv * head_dim
    attention = h * q + 2 * h * k + q * h
    if c["model_type"] == "qwen2" or c.get("attention_bias"):
        attention += q + 2 * k + (h if c.get("attention_bias") else 0)  # qwen2: q, k, v biases, not o
    mlp = 3 * h * inter + (2 * inter + h if c.get("mlp_bias") else 0)
    norms = (4 if c["model_type"] == "gemma2" else 2) * h
    tied = c.get("tie_word_embeddings", c["model_type"] == "gemma2")
    embedding = vocab * h
    total = layers * (attention + mlp + norms) + h + embedding * (1 if tied else 2)
    largest = max(embedding, h * q, h * inter)
    return total, largest


# Mixture-of-experts families: the config keys their shapes depend on, with the defaults of transformers 5.24's
# config classes (MixtralConfig, Qwen2MoeConfig, ...) for a config.json that leaves one out.
MOE_DEFAULTS = {
    "mixtral": {"num_local_experts": 8, "tie_word_embeddings": False},
    "qwen2_moe": {"num_experts": 60, "decoder_sparse_step": 1, "mlp_only_layers": [], "qkv_bias": True,
                  "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "tie_word_embeddings": False},
    "qwen3_moe": {"num_experts": 128, "decoder_sparse_step": 1, "mlp_only_layers": [], "attention_bias": False,
                  "moe_intermediate_size": 768, "tie_word_embeddings": False},
    "olmoe": {"num_experts": 64, "attention_bias": False, "tie_word_embeddings": False},
    "deepseek_v2": {"n_routed_experts": 64, "n_shared_experts": 2, "first_k_dense_replace": 0,
                    "moe_intermediate_size": 1407, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
                    "qk_rope_head_dim": 64, "v_head_dim": 128, "attention_bias": False, "mlp_bias": False,
                    "tie_word_embeddings": False},
    "deepseek_v3": {"n_routed_experts": 256, "n_shared_experts": 1, "first_k_dense_replace": 3,
                    "moe_intermediate_size": 2048, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
                    "qk_rope_head_dim": 64, "v_head_dim": 128, "attention_bias": False, "tie_word_embeddings": False},
    "dbrx": {"tie_word_embeddings": False},
}
EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def _moe(config: Mapping[str, Any]) -> Tuple[int, int]:
    """Every expert of every layer (memory holds them all, however few a token uses), as transformers 5.24 builds
    them: one fused experts module per MoE layer (gate_up_proj E·2I·h, down_proj E·h·I) and a router E·h."""
    kind = config["model_type"]
    c = {**MOE_DEFAULTS[kind], **config}
    if kind == "dbrx":  # modeling_dbrx.py: fused Wqkv, bias-free LayerNorms, experts w1, v1, w2 of E·F x d each
        h, layers, vocab, heads = c["d_model"], c["n_layers"], c["vocab_size"], c["n_heads"]
        attn, ffn = c.get("attn_config") or {}, c.get("ffn_config") or {}
        kv, experts, inter = attn.get("kv_n_heads", 1), ffn.get("moe_num_experts", 4), ffn.get("ffn_hidden_size", 3584)
        for value in (kv, experts, inter):
            if not is_int(value) or not 1 <= value <= 1 << 23:
                raise ValueError(f"dbrx attn_config/ffn_config holds {value!r} where a positive integer belongs")
        expert_block = 3 * experts * inter * h
        layer = h * (h + 2 * kv * (h // heads)) + h * h + 2 * h + experts * h + expert_block
        embedding = vocab * h
        return layers * layer + h + embedding * (1 if c["tie_word_embeddings"] else 2), max(embedding, expert_block)
    h, layers, vocab, heads = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"], c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or h // heads
    q, k = heads * head_dim, kv * head_dim
    experts = c[next(key for key in EXPERT_COUNTS if key in c)]
    if not is_int(experts) or not 0 <= experts <= 1 << 16:  # num_experts 0 is a dense Qwen MoE config
        raise ValueError(f"the expert count is {experts!r}; a model config holds a whole number up to 65536 there")
    shared = c.get("n_shared_experts") or 0  # DeepSeek: null, no shared experts
    if not is_int(shared) or not 0 <= shared <= 1 << 16:
        raise ValueError(f"n_shared_experts is {shared!r}; a model config holds a whole number up to 65536 there")
    inter = c.get("moe_intermediate_size") if kind != "mixtral" and kind != "olmoe" else c["intermediate_size"]
    if kind in ("deepseek_v2", "deepseek_v3"):  # multi-head latent attention (modeling_deepseek_v2.py)
        lora, kv_lora, rope = c["q_lora_rank"], c["kv_lora_rank"], c["qk_rope_head_dim"]
        qk_dim, bias = c["qk_nope_head_dim"] + rope, bool(c["attention_bias"])
        attention = (h * heads * qk_dim if lora is None else h * lora + bias * lora + lora + lora * heads * qk_dim)
        attention += h * (kv_lora + rope) + bias * (kv_lora + rope) + kv_lora  # kv_a_proj_with_mqa, its norm
        attention += kv_lora * heads * (c["qk_nope_head_dim"] + c["v_head_dim"])  # kv_b_proj
        attention += heads * c["v_head_dim"] * h + bias * h  # o_proj
    else:
        attention = 2 * h * q + 2 * h * k
        if c.get("qkv_bias") if kind == "qwen2_moe" else c.get("attention_bias"):
            attention += q + 2 * k + (h if kind != "qwen2_moe" else 0)  # qwen2_moe: q, k, v biases, not o
        attention += {"qwen3_moe": 2 * head_dim, "olmoe": q + k}.get(kind, 0)  # q_norm, k_norm
    expert_block = experts * 3 * h * inter
    moe = experts * h + expert_block
    if kind == "qwen2_moe":  # a shared expert and its gate (modeling_qwen2_moe.py Qwen2MoeSparseMoeBlock)
        moe += 3 * h * c["shared_expert_intermediate_size"] + h
    elif kind in ("deepseek_v2", "deepseek_v3"):
        moe += 3 * h * inter * shared
    dense_mlp = 3 * h * c.get("intermediate_size", 0) + (
        2 * c.get("intermediate_size", 0) + h if kind == "deepseek_v2" and c.get("mlp_bias") else 0)

    dense_only = set(c["mlp_only_layers"] or ()) if kind in ("qwen2_moe", "qwen3_moe") else set()

    def sparse(i: int) -> bool:  # which layers are MoE, as each decoder layer decides
        if kind in ("qwen2_moe", "qwen3_moe"):
            return i not in dense_only and experts > 0 and (i + 1) % c["decoder_sparse_step"] == 0
        if kind in ("deepseek_v2", "deepseek_v3"):  # transformers reads first_k_dense_replace only (not moe_layer_freq)
            return i >= c["first_k_dense_replace"]
        return True

    n_sparse = sum(1 for i in range(layers) if sparse(i))
    embedding = vocab * h
    total = layers * (attention + 2 * h) + n_sparse * moe + (layers - n_sparse) * dense_mlp + h + embedding * (
        1 if c["tie_word_embeddings"] else 2)
    return total, max(embedding, expert_block if n_sparse else 0, h * q)


def _gpt2(c: Mapping[str, Any]) -> Tuple[int, int]:
    h, layers, vocab, positions = c["n_embd"], c["n_layer"], c["vocab_size"], c["n_positions"]
    inner = c.get("n_inner") or 4 * h
    block = (h * 3 * h + 3 * h) + (h * h + h) + (h * inner + inner) + (inner * h + h) + 4 * h  # c_attn, c_proj, mlp, ln
    return vocab * h + positions * h + layers * block + 2 * h, vocab * h


def _on_meta_device(config: Mapping[str, Any]) -> Optional[Tuple[int, int]]:
    """The model built on the meta device, as accelerate's estimate-memory does; None without transformers."""
    try:
        import torch
        import transformers
    except ImportError:
        return None
    try:
        cfg = transformers.AutoConfig.for_model(**dict(config))
        with torch.device("meta"):  # (accelerate's init_empty_weights leaves tied embeddings untied here)
            try:
                model = transformers.AutoModelForCausalLM.from_config(cfg)
            except ValueError:
                model = transformers.AutoModel.from_config(cfg)
    except Exception:  # a model_type this transformers does not know, or a config it cannot build: estimate
        return None
    total = sum(p.numel() for p in model.parameters())  # a shared parameter is listed once
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return int(total), int(largest)


# --- the inputs: flags, else the profile ----------------------------------------------------------------

@dataclass(frozen=True)
class Inputs:
    model: Optional[Model] = None
    gpu_bytes: Optional[int] = None  # --gpu-memory: what lint compares against (each GPU)
    host_bytes: Optional[int] = None  # --host-memory: per node
    seq_len: Optional[int] = None


PROFILE_KEYS = ("model", "gpu_memory", "host_memory", "seq_len")


def inputs(args, profile=None) -> Inputs:
    """--model, --gpu-memory, --host-memory, --seq-len, each else the profile's [memory] key."""
    kept = dict(profile.memory) if profile is not None and getattr(profile, "memory", None) else {}

    def value(flag: str, key: str):
        given = getattr(args, flag, None)
        if given is not None:
            return given, f"--{flag.replace('_', '-')}"
        return kept.get(key), f"{profile.path if profile is not None else ''} [memory] {key}"

    model, where = value("model", "model")
    found = Inputs(model=resolve(str(model), where) if model is not None else None)
    for flag, key, field in (("gpu_memory", "gpu_memory", "gpu_bytes"), ("host_memory", "host_memory", "host_bytes")):
        given, where = value(flag, key)
        if given is not None:
            try:
                found = replace(found, **{field: parse_size(given, where)})
            except ValueError as exc:
                raise InputError(where, str(exc)[len(where) + 1:]) from None
    seq, where = value("seq_len", "seq_len")
    if seq is not None:
        return replace(found, seq_len=parse_seq_len(seq, where))
    return found


def parse_seq_len(seq: Any, where: str) -> int:
    """A whole number of tokens up to MAX_SEQ_LEN (the text's length checked before int() reads it)."""
    if isinstance(seq, str) and re.fullmatch(r"\s*[0-9]{1,9}\s*", seq):
        seq = int(seq)
    if is_int(seq) and 1 <= seq <= MAX_SEQ_LEN:
        return seq
    if isinstance(seq, int) and not -10**18 < seq < 10**18:
        shown = "a number that large"  # (repr of an int past 4300 digits raises)
    else:
        shown = repr(seq[:32] if isinstance(seq, str) else seq)[:40]
    raise InputError(where, f"{shown} is not a sequence length (a whole number of tokens, 1 to {MAX_SEQ_LEN})")
