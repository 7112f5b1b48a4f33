"""What a report may show of a command line, a setting or an environment: the values of names that look
secret, the user:password@ of URLs and Hugging Face tokens, replaced by <redacted>. The one place for it:
`results` is applied to every run's results before anything is printed or written (terminal, JSON, JUnit,
HTML, Prometheus, a SLURM drain reason), and the checks that quote a setting use `value` and `argv`."""
from __future__ import annotations

import functools
import re
from dataclasses import replace
from typing import Any, Iterable, List, Optional, Sequence, Set

# A name that looks secret (HF_TOKEN, --password=, --api-key, trainer.hf_token; not KEYBOARD), and URL credentials
# and Hugging Face tokens in any text: the node's rules (the census applies them before it cuts an argument), so
# that a node and every output agree.
from preflight.node.secret import REDACTED, secret_name, secret_text

# A word an HTTP credential follows (`-H "Authorization: Bearer" TOKEN`).
HTTP_SCHEME = re.compile(r"(^Bearer|Authorization:\s*(Basic|Bearer))$", re.I)
# NAME=value as a shell, Hydra (trainer.hf_token=, +wandb.api_key=) or a launcher takes it.
ASSIGNMENT = re.compile(r"^\+{0,2}[A-Za-z_][A-Za-z0-9_.-]*=")
# What a text must hold to be worth a closer look (most messages hold none of it: they are returned as they are):
# every word of secret_name's rule, the @ of URL credentials, the hf_ of a Hugging Face token, an HTTP credential.
SUSPECT_WORDS = ("token", "secret", "pass", "pwd", "auth", "key", "credential", "@", "hf_", "bearer")
SUSPECT = re.compile("|".join(SUSPECT_WORDS), re.I)


def suspect(said: str) -> bool:
    """Whether SUSPECT is in `said`. An ASCII text by substring (an IGNORECASE search tries every position:
    20 us a result at thousands of results); in any other, re's IGNORECASE also takes K (Kelvin) for k, so the
    search decides."""
    if said.isascii():
        low = said.lower()
        return any(word in low for word in SUSPECT_WORDS)
    return SUSPECT.search(said) is not None
# Evidence of a setting: {"variable" or "key" or "name": NAME, "value": ..., "expected": ...}.
NAMING_KEYS = ("variable", "key", "name")


@functools.lru_cache(maxsize=65536)  # the same messages come back for every node
def text(value: str) -> str:
    """A string with its secrets redacted: URL credentials, Hugging Face tokens, and the values of
    `--token X`, `--password=X`, `NAME=X` written in it (as in a command line)."""
    if not suspect(value):
        return value
    value = secret_text(value)  # across words too (`Bearer TOKEN`)
    pieces = re.split(r"(\s+)", value)  # words and the spaces between them, kept as they were
    pieces[0::2] = argv(pieces[0::2])
    return "".join(pieces)


def value(name: str, found: Any) -> Any:
    """A setting's value as a report may show it: redacted when its name looks secret."""
    if secret_name(name.rsplit(".", 1)[-1]) and found not in (None, "", True, False):
        return REDACTED
    return text(found) if isinstance(found, str) else found


def argv(words: Sequence[str]) -> List[str]:
    """A command line as it may be shown: the value of an option or NAME=value whose name looks secret
    (`--token X`, `--password=X`, `--hf_token X`, `--api-key X`, `HF_TOKEN=X`, `trainer.hf_token=X`), Hugging
    Face tokens and the user:password@ of URLs replaced by <redacted>."""
    shown: List[str] = []
    hide_next = False
    for word in words:
        if hide_next and word and not word.startswith(("-", REDACTED)):
            shown.append(REDACTED)
            hide_next = False
            continue
        hide_next = hide_next and not word  # the empty words of text()'s split do not count
        if HTTP_SCHEME.search(word):  # `-H "Authorization: Bearer" TOKEN`: the credential is the next word
            shown.append(word)
            hide_next = True
            continue
        name, has_value, _ = word.partition("=")
        if secret_name(name) and (word.startswith("-") or (has_value and ASSIGNMENT.match(word))):
            if has_value:
                shown.append(f"{name}={REDACTED}")
            else:
                shown.append(word)
                hide_next = word.startswith("-")
            continue
        shown.append(secret_text(word))
    return shown


def results(found: Iterable[Any]) -> List[Any]:
    """Results (preflight.result.Result) as every output may show them: message, remediation and evidence
    redacted. In evidence, a value under a secret name is redacted, and so is a setting's value when the
    setting's name looks secret ({"variable": "HF_TOKEN", "value": ...}); such a value is then also taken out
    of that result's message (`HF_TOKEN is X on n2`)."""
    shown = []
    for r in found:
        if not suspect(_said(r)):
            shown.append(r)  # most results: no word a secret is named by, no URL, no token in any of their text
            continue
        hidden: Set[str] = set()
        evidence = _evidence(r.evidence, hidden)
        message, remediation = _scrub(r.message, hidden), _scrub(r.remediation, hidden)
        if evidence is r.evidence and message is r.message and remediation is r.remediation:
            shown.append(r)  # most results: nothing to hide, no copy
        else:
            shown.append(replace(r, message=message, remediation=remediation, evidence=evidence))
    return shown


def _said(r: Any) -> str:
    """What of a result suspect() is asked about: its message, its fix and its evidence's repr; but a large table in
    the evidence (rows of plain values) by the repr of its distinct keys and values: doctor's census of 16,384
    nodes is 147,456 rows, 36 MB of repr, of a few thousand values. The same answer: no word of SUSPECT_WORDS holds
    a quote, comma, colon, space or bracket, so none spans two keys or values of a repr."""
    if type(r.evidence) is dict:
        for value in r.evidence.values():  # a loop, not any(): every result of 16,384 nodes passes here
            if type(value) is list and len(value) > TABLE_ROWS:
                return "\0".join([str(r.message), str(r.remediation), *(
                    repr(key) + repr(_distinct(value) or value) for key, value in r.evidence.items())])
    return f"{r.message}\0{r.remediation}\0{r.evidence!r}"


TABLE_ROWS = 1000  # rows from which a table is looked at by its distinct values


def _distinct(table: Any) -> Optional[set]:
    """The keys and values of a table's rows, each once; None for anything that is not a list of rows of plain
    (hashable) values."""
    if type(table) is not list or not table or not all(type(row) is dict for row in table):
        return None
    try:
        return set().union(*table, *(row.values() for row in table))
    except TypeError:  # a list or a dict in a row
        return None


def _scrub(said: Any, hidden: Set[str]) -> Any:
    if not isinstance(said, str):
        return said
    for secret in sorted(hidden, key=len, reverse=True):
        said = said.replace(secret, REDACTED)
    return text(said)


def _evidence(data: Any, hidden: Set[str]) -> Any:
    """`data` with its secrets redacted (the same object when there are none); what was hidden goes in `hidden`."""
    if isinstance(data, str):
        return text(data)
    if isinstance(data, (list, tuple)):
        if all(isinstance(x, str) for x in data):
            out = argv(data)
            return data if out == list(data) else type(data)(out)
        out = [_evidence(x, hidden) for x in data]
        return data if all(a is b for a, b in zip(out, data)) else type(data)(out)
    if not isinstance(data, dict):
        return data
    setting = any(isinstance(data.get(k), str) and secret_name(data[k].rsplit(".", 1)[-1]) for k in NAMING_KEYS)
    out = {}
    for key, item in data.items():
        secret = key not in NAMING_KEYS and (setting or isinstance(key, str) and secret_name(key))
        if secret and item not in (None, "", True, False, REDACTED):
            _remember(item, hidden)
            out[key] = REDACTED
        else:
            out[key] = _evidence(item, hidden)
    return data if all(out[k] is data[k] for k in data) else out


def _remember(item: Any, hidden: Set[str]) -> None:
    """The strings of a redacted value, to take out of the result's message too (short ones would blank
    ordinary words)."""
    if isinstance(item, str) and len(item) >= 4:
        hidden.add(item)
    elif isinstance(item, (list, tuple)):
        for x in item:
            _remember(x, hidden)
    elif isinstance(item, dict):
        for x in item.values():
            _remember(x, hidden)
    elif isinstance(item, (int, float)) and len(str(item)) >= 4:
        hidden.add(str(item))
