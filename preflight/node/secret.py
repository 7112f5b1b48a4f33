"""The one rule for a name that looks secret, decided by its parts (split at - _ .): HF_TOKEN, WANDB_API_KEY,
DB_PASSWD, NCCL_AUTH; not KEYBOARD, TOKENIZERS_PARALLELISM, NCCL_IB_HCA, NCCL_IB_PKEY. Values under such
names never leave the node; every output is redacted again by the same rule on the head (preflight.report.redact)."""
import re

SECRET_NAME = re.compile(r"(^|[-_.])(token|secret|passwords?|passwd|passphrase|pwd|auth|authorization|api[-_]?key|"
                         r"key|credentials?)($|[-_.])", re.I)
NOT_SECRET = frozenset(("PWD", "OLDPWD"))  # the shell's working directories
REDACTED = "<redacted>"


def secret_name(name):
    name = name.lstrip("-+")
    return name.upper() not in NOT_SECRET and bool(SECRET_NAME.search(name))
