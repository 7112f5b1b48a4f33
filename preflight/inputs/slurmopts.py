"""sbatch's and srun's options as Slurm parses them: the option tables of src/common/slurm_opt.c (with pyxis's
container options), getopt_long's reading of a command line, and the words of an `#SBATCH` line as sbatch's
get_argument takes them (quotes group, `#` starts a comment, no shell expands anything)."""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence

# Options as Slurm's src/common/slurm_opt.c declares them (has_arg), srun's and sbatch's. Short ones taking a value:
SBATCH_SHORT = {"-A": "account", "-B": "extra-node-info", "-C": "constraint", "-D": "chdir", "-F": "nodefile",
                "-G": "gpus", "-J": "job-name", "-L": "licenses", "-M": "clusters", "-N": "nodes", "-S": "core-spec",
                "-a": "array", "-b": "begin", "-c": "cpus-per-task", "-d": "dependency", "-e": "error", "-i": "input",
                "-m": "distribution", "-n": "ntasks", "-o": "output", "-p": "partition", "-q": "qos", "-t": "time",
                "-w": "nodelist", "-x": "exclude"}
SBATCH_SHORT_FLAGS = {"-H": "hold", "-O": "overcommit", "-Q": "quiet", "-V": "version", "-h": "help", "-k": "no-kill",
                      "-s": "oversubscribe", "-v": "verbose", "-W": "wait"}
SRUN_SHORT = {**{k: v for k, v in SBATCH_SHORT.items() if k not in ("-a",)}, "-T": "threads", "-W": "wait",
              "-r": "relative"}
SRUN_SHORT_FLAGS = {"-E": "preserve-env", "-H": "hold", "-O": "overcommit", "-Q": "quiet", "-V": "version",
                    "-X": "disable-status", "-Z": "no-allocate", "-h": "help", "-l": "label", "-s": "oversubscribe",
                    "-u": "unbuffered", "-v": "verbose", "-I": "immediate", "-K": "kill-on-bad-exit", "-k": "no-kill"}
SRUN_FLAGS = frozenset("""async consolidate-segments contiguous debugger-test disable-status exact help hold interactive
label multi-prog no-allocate overcommit oversubscribe parsable preserve-env quiet quit-on-interrupt reboot spread-job
spread-segments stepmgr test-only unbuffered usage use-min-nodes verbose version wait-for-children whole
container-mount-home no-container-mount-home container-remap-root no-container-remap-root container-entrypoint
no-container-entrypoint container-entrypoint-log container-writable container-readonly""".split())  # + pyxis's
SRUN_OPTIONAL = frozenset("""bcast compress exclusive external-launcher immediate kill-on-bad-exit nice no-kill
oom-kill-step overlap propagate pty resv-ports send-libs x11""".split())  # a value only as --opt=VALUE
ALIASES = {"tasks-per-node": "ntasks-per-node", "mem-per-node": "mem", "workdir": "chdir", "cpu_bind": "cpu-bind"}
# The SBATCH_* input environment variables this reader uses, as the option each stands for (sbatch(1), INPUT
# ENVIRONMENT VARIABLES; SBATCH_NODES, SBATCH_NTASKS and SBATCH_NTASKS_PER_NODE are not among them).
SBATCH_ENV = {"SBATCH_GPUS": "gpus", "SBATCH_GPUS_PER_NODE": "gpus-per-node", "SBATCH_GPUS_PER_TASK": "gpus-per-task",
              "SBATCH_GRES": "gres", "SBATCH_EXPORT": "export", "SBATCH_DISTRIBUTION": "distribution",
              "SBATCH_EXCLUSIVE": "exclusive", "SBATCH_PARTITION": "partition", "SBATCH_CPUS_PER_GPU": "cpus-per-gpu"}


def options(words: Sequence[str], short: Mapping[str, str], short_flags: Mapping[str, str], flags=frozenset(),
            optional=frozenset(), stop_at_word: bool = True):
    """(options, index of the first word that is not one) of sbatch's or srun's getopt_long; long names."""
    found: Dict[str, Optional[str]] = {}
    i = 0
    while i < len(words):
        word = words[i]
        if word == "--":
            return found, i + 1
        if word.startswith("--"):
            name, eq, value = word[2:].partition("=")
            name = ALIASES.get(name, name)
            if eq:
                found[name] = value
            elif name in flags or name in optional:
                found[name] = None
            elif i + 1 < len(words):
                found[name] = words[i + 1]
                i += 1
            else:
                found[name] = ""
        elif word.startswith("-") and len(word) >= 2 and word[:2] in short:
            if len(word) > 2:
                found[short[word[:2]]] = word[2:].lstrip("=")
            elif i + 1 < len(words):
                found[short[word[:2]]] = words[i + 1]
                i += 1
        elif word.startswith("-") and len(word) >= 2 and word[:2] in short_flags:
            found[short_flags[word[:2]]] = None
        elif stop_at_word:
            return found, i
        i += 1
    return found, i


def directive_words(rest: str) -> List[str]:
    """The words of an #SBATCH line after the tag, as sbatch's get_argument takes them: blanks separate, single or
    double quotes group, a backslash escapes, an unquoted `#` starts a comment; no shell expands anything."""
    words, current, quote, i, started = [], [], "", 0, False
    while i < len(rest):
        c = rest[i]
        if quote:
            if c == quote:
                quote = ""
            else:
                current.append(c)
        elif c == "\\" and i + 1 < len(rest):
            i += 1
            current.append(rest[i])
            started = True
        elif c in "\"'":
            quote, started = c, True
        elif c.isspace():
            if started:
                words.append("".join(current))
                current, started = [], False
        elif c == "#":
            break
        else:
            current.append(c)
            started = True
        i += 1
    if started:
        words.append("".join(current))
    return words
