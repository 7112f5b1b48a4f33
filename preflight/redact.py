"""What a report may show of a command line or a setting: values whose names look secret, and the
user:password@ of URLs, replaced by <redacted>. One place for every renderer and check."""
from __future__ import annotations

import re
from typing import Any, List, Sequence

REDACTED = "<redacted>"
# A name that looks secret: --token, --hf_token, --password=, --api-key, WANDB_API_KEY=, trainer.hf_token=.
SECRET_NAME = re.compile(r"(^|[-_.])(token|secret|password|passwd|pwd|auth|api[-_]?key|key|credentials?)($|[-_.])",
                         re.I)
URL_CREDENTIALS = re.compile(r"\b([a-z][a-z0-9+.-]*://)[^/\s@:]*:[^/\s@]*@", re.I)
# NAME=value as a shell, Hydra (trainer.hf_token=, +wandb.api_key=) or a launcher takes it.
ASSIGNMENT = re.compile(r"^\+{0,2}[A-Za-z_][A-Za-z0-9_.-]*=")


def secret_name(name: str) -> bool:
    return bool(SECRET_NAME.search(name.lstrip("-+")))


def text(value: str) -> str:
    """A string with the credentials of the URLs in it redacted."""
    return URL_CREDENTIALS.sub(lambda m: m.group(1) + REDACTED + "@", value)


def value(name: str, found: Any) -> Any:
    """A setting's value as a report may show it: redacted when its name looks secret."""
    if secret_name(name.rsplit(".", 1)[-1]) and found not in (None, "", True, False):
        return REDACTED
    return text(found) if isinstance(found, str) else found


def argv(words: Sequence[str]) -> List[str]:
    """A command line as it may be shown: the value of an option or NAME=value whose name looks secret
    (`--token X`, `--password=X`, `--hf_token X`, `--api-key X`, `HF_TOKEN=X`, `trainer.hf_token=X`) and
    the user:password@ of URLs replaced by <redacted>."""
    shown: List[str] = []
    hide_next = False
    for word in words:
        if hide_next and not word.startswith("-"):
            shown.append(REDACTED)
            hide_next = False
            continue
        hide_next = False
        name, has_value, _ = word.partition("=")
        if secret_name(name) and (word.startswith("-") or (has_value and ASSIGNMENT.match(word))):
            if has_value:
                shown.append(f"{name}={REDACTED}")
            else:
                shown.append(word)
                hide_next = word.startswith("-")
            continue
        shown.append(text(word))
    return shown
