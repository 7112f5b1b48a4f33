"""The one rule for a name that looks secret, decided by its parts (split at - _ .): HF_TOKEN, WANDB_API_KEY,
DB_PASSWD, NCCL_AUTH; not KEYBOARD, TOKENIZERS_PARALLELISM, NCCL_IB_HCA, NCCL_IB_PKEY. Values under such
names never leave the node; every output is redacted again by the same rule on the head (preflight.report.redact).
Secrets in free text (a URL's user:password@, a Hugging Face token, an HTTP Bearer or Basic credential, a secret
NAME=value in a comma-joined list) are found by `secret_text`, on the node before
a command-line argument is cut and on the head in every output."""
import re

SECRET_NAME = re.compile(r"(^|[-_.])(token|secret|passwords?|passwd|passphrase|pwd|auth|authorization|api[-_]?key|"
                         r"key|credentials?)($|[-_.])", re.I)
NOT_SECRET = frozenset(("PWD", "OLDPWD"))  # the shell's working directories
REDACTED = "<redacted>"
URL_CREDENTIALS = re.compile(r"\b([a-z][a-z0-9+.-]*://)[^/\s@:]*:[^/\s@]*@", re.I)
HF_TOKEN = re.compile(r"\bhf_[A-Za-z0-9]{30,}\b")
# An HTTP credential: `Bearer TOKEN` (RFC 6750), `Authorization: Basic B64` (RFC 7617; `basic` alone is a word)
HTTP_CREDENTIAL = re.compile(r"\b(Bearer|Authorization:\s*Basic)\s+(?!<redacted>)[A-Za-z0-9._~+/-]{8,}=*", re.I)
# NAME=value in a comma-joined list (`srun --export=ALL,WANDB_API_KEY=...`, `--env A=1,B=2`)
LIST_ITEM = re.compile(r"(?<=[,=])([A-Za-z_][A-Za-z0-9_.-]*)=([^,\s]+)")


def secret_name(name):
    name = name.lstrip("-+")
    return name.upper() not in NOT_SECRET and bool(SECRET_NAME.search(name))


def secret_text(text):
    """`text` with URL credentials, Hugging Face tokens, HTTP credentials and the secret-named items of a
    comma-joined NAME=value list replaced by REDACTED."""
    text = URL_CREDENTIALS.sub(lambda m: m.group(1) + REDACTED + "@", text)
    text = HTTP_CREDENTIAL.sub(lambda m: m.group(1) + " " + REDACTED, text)
    if "," in text:
        text = LIST_ITEM.sub(lambda m: m.group(1) + "=" + REDACTED if secret_name(m.group(1)) and
                             m.group(2) != REDACTED else m.group(0), text)
    return HF_TOKEN.sub(REDACTED, text)
