"""Shipping a program of preflight.node to a node that has nothing of preflight installed.

The remote command is fixed: a constant sh keeper that ends the program with its session, the interpreter's
path, quoted, and a constant bootstrap. Everything else travels on stdin: a length line, the bundle (the
sources of preflight.node's modules and the name of the program's module, as JSON), one line of JSON
options; then, for the agent, its requests. Nothing a user typed is ever part of a shell command unquoted.

The bootstrap is the loader: it makes each shipped source a module of its package (preflight.node.NAME),
found before anything installed on the node under the same names, so node code imports its siblings on the
node exactly as it does in-process. It refuses an interpreter older than preflight.node.MIN_PYTHON in one
line (preflight.node.unsupported), then calls the program module's main(options).
"""
from __future__ import annotations

import base64
import functools
import importlib.machinery
import importlib.util
import json
import marshal
import os
import re
import shlex
import threading
import types
import zlib

import preflight.node
from preflight.node import PROGRAM_MARK

AGENT = "preflight.node.agent"  # the facts, then answers to the head's requests
ALLREDUCE = "preflight.node.allreduce"  # the all-reduce worker

# Reads a length line, that many bytes of the bundle, loads the program and runs its prepare() if it has one, then
# reads one line of JSON options and runs main (so that a head may send the options later: remote.early). It
# reads fd 0 unbuffered, so that what follows (the agent's requests) is left for the agent to read. Written
# in the syntax Python 2.7 compiles, as preflight.node's __init__ is, so an old interpreter is named, not
# left at a SyntaxError.
BOOTSTRAP = PROGRAM_MARK + (
    "import os,sys,json\n"
    "def line():\n"
    " b=b''\n"
    " while not b.endswith(b'\\n'):\n"
    "  c=os.read(0,1)\n"
    "  if not c:break\n"
    "  b+=c\n"
    " return b\n"
    "n=int(line());s=b''\n"
    "while len(s)<n:\n"
    " c=os.read(0,n-len(s))\n"
    " if not c:break\n"
    " s+=c\n"
    "B=json.loads(s.decode('utf-8'));M=B['modules'];K={}\n"
    "def code(name):\n"
    " if name in K:return K[name]\n"
    " return compile(M[name],'preflight-shipped/'+name.replace('.','/')+'.py','exec')\n"
    "g={'__name__':'preflight_node'};exec(code('preflight.node'),g)\n"
    "u=g['unsupported']()\n"
    "if u:\n"
    " sys.stderr.write(u);sys.exit(3)\n"
    "import importlib,importlib.util\n"
    # The head's bytecode, when this interpreter reads the same (its magic number): no compiling on every node.
    "if B.get('code') and B.get('magic')==importlib.util.MAGIC_NUMBER.hex():\n"
    " try:\n"
    "  import base64,marshal,zlib;K=marshal.loads(zlib.decompress(base64.b64decode(B['code'])))\n"
    " except Exception:K={}\n"
    "class Shipped(object):\n"
    " def find_spec(self,name,path=None,target=None):\n"
    "  if name in M:return importlib.util.spec_from_loader(name,self,is_package=name in B['packages'])\n"
    " def create_module(self,spec):return None\n"
    " def exec_module(self,module):exec(code(module.__name__),module.__dict__)\n"
    "sys.meta_path.insert(0,Shipped())\n"
    "for m in [k for k in sys.modules if k=='preflight' or k.startswith('preflight.')]:del sys.modules[m]\n"
    "P=importlib.import_module(B['main'])\n"
    "if hasattr(P,'prepare'):\n"
    " R=P.prepare();P.main(json.loads(line()),R)\n"
    "else:P.main(json.loads(line()))\n"
)


@functools.lru_cache(maxsize=None)
def bundle(program: str) -> str:
    """The JSON text a node's bootstrap loads: the program's module of preflight.node and every module of it that
    it imports, at any depth (a lazy import too: the census comes with the agent), and the program to run."""
    folder = os.path.dirname(preflight.node.__file__)
    sources = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            with open(os.path.join(folder, name), encoding="utf-8") as handle:
                sources["preflight.node" if name == "__init__.py" else "preflight.node." + name[:-3]] = handle.read()
    if program not in sources:
        raise ValueError(f"{program} is not a module of preflight.node")
    # The head's package face is not needed on the node: "preflight" there holds only the head's version.
    modules = {"preflight": f"__version__ = {preflight.__version__!r}\n", "preflight.node": sources["preflight.node"]}
    pending = [program]
    while pending:
        name = pending.pop()
        if name not in modules:
            modules[name] = sources[name]
            pending.extend(_node_imports(sources[name], sources))
    return json.dumps({"main": program, "packages": ["preflight", "preflight.node"], "modules": modules,
                       "magic": importlib.util.MAGIC_NUMBER.hex(), "code": _bytecode(modules, folder)})


def _bytecode(modules: dict, folder: str) -> str:
    """The modules' code for an interpreter with this one's magic number, as the bootstrap loads it: a marshalled
    {name: code}, zlib, base64 (70 KB for the agent). Compiling the agent's 95 KB of source took 70-140 ms of
    CPU on every node; here it is the head's bytecode cache (what pip wrote), read once, each code object named
    as the bootstrap names what it compiles."""
    code = {}
    for name, source in modules.items():
        shipped = "preflight-shipped/" + name.replace(".", "/") + ".py"
        path = os.path.join(folder, "__init__.py" if name == "preflight.node" else name.rpartition(".")[2] + ".py")
        if name.startswith("preflight.node") and os.path.isfile(path):
            code[name] = _renamed(importlib.machinery.SourceFileLoader(name, path).get_code(name), shipped)
        else:  # the head's version line
            code[name] = compile(source, shipped, "exec")
    return base64.b64encode(zlib.compress(marshal.dumps(code))).decode()


def _renamed(code: types.CodeType, filename: str) -> types.CodeType:
    """code, and the functions and classes it defines, as compiled from `filename`."""
    consts = tuple(_renamed(c, filename) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)


# `from preflight.node import a, b`, `from preflight.node.a import x`, `import preflight.node.a` (read as text:
# parsing every module's syntax tree would cost each run tens of milliseconds).
NODE_IMPORT = re.compile(r"^[ \t]*(?:from[ \t]+(preflight\.node(?:\.\w+)?)[ \t]+import[ \t]+(\([^)]*\)|[^\n#]+)"
                         r"|import[ \t]+(preflight\.node\.\w+))", re.M)


def _node_imports(source: str, sources: dict) -> list:
    """The modules of preflight.node that a source imports, at any depth of its code."""
    found = []
    for package, names, module in NODE_IMPORT.findall(source):
        if module:
            found.append(module)
        elif package == "preflight.node":
            found += [f"preflight.node.{n.split(' as ')[0].strip()}" for n in names.strip("()").split(",") if n.strip()]
        else:
            found.append(package)
    return [name for name in found if name in sources]


# The program runs under a keeper, in plain sh, so that it ends with its session whatever the interpreter
# does: an exec channel has no terminal, so sshd sends no SIGHUP and a program that ignores the end of
# its input would outlive preflight. The keeper gives the program a private TMPDIR, starts RELAY in a
# session of its own (setsid), and when the session's input ends (RELAY signals USR1) allows a second,
# then kills that whole process group; it removes the TMPDIR (a killed program leaves no files) and exits
# with the program's status (127: no such interpreter). Once the session is gone its output is too: a
# word on it (sh's "Killed") would end the keeper by SIGPIPE. Arguments: the interpreter, the bootstrap, RELAY.
# A background job's stdin is /dev/null in sh: fd 3 carries the session's input to it. Without setsid
# (util-linux, busybox) the interpreter runs as before, unkept.
KEEPER = (
    'command -v setsid >/dev/null 2>&1 || exec "$1" -u -c "$2"\n'
    'd=$(mktemp -d "${TMPDIR:-/tmp}/preflight.XXXXXX" 2>/dev/null) && export TMPDIR="$d"\n'
    "e=; trap 'e=1' USR1\n"
    "exec 3<&0\n"
    # A TERM, HUP or INT (slurmstepd ending a step, a scope stopped, a test cluster torn down) ends it as the
    # end of the session does: the program's group killed and its folder removed. Set before the program
    # starts, and by $! (set as soon as it forks): a signal in between must not leave it running.
    'trap \'kill -s KILL -- -$! 2>/dev/null; [ -n "$d" ] && rm -rf "$d"; exit 143\' TERM HUP INT\n'
    'setsid /bin/sh -c "$3" preflight $$ "$1" "$2" <&3 3<&- &\n'
    "p=$!\n"
    "wait $p; c=$?\n"
    'if [ -n "$e" ]; then exec >/dev/null 2>&1; sleep 1; kill -s KILL -- -$p; wait $p; c=$?; fi\n'
    "kill -s KILL -- -$p 2>/dev/null\n"
    '[ -n "$d" ] && rm -rf "$d"\n'
    "exit $c\n"
)
# The program's input goes through cat, which sees the session's input end even when the program does not
# read it; then it tells the keeper ($1). When the program ends first, the rest of this group (cat) is
# ended so that its status goes back at once (SIGPIPE: sh prints nothing about it). Arguments: the keeper's
# PID, the interpreter, the bootstrap.
RELAY = (
    "trap : PIPE\n"
    '{ cat; kill -s USR1 $1 2>/dev/null; } | { "$2" -u -c "$3"; c=$?; trap \'\' PIPE; kill -s PIPE 0; exit $c; }\n'
)


def shipped_command(python: str) -> str:
    """The remote command line: the keeper with the interpreter's path, the bootstrap and the relay, each quoted."""
    return "exec /bin/sh -c " + " ".join(shlex.quote(a) for a in (KEEPER, "preflight", python, BOOTSTRAP, RELAY))


_BUNDLING = threading.Lock()  # every node's thread asks for the bundle at once: it is made once


def shipped_input(program: str, options: dict) -> str:
    """What the command reads first: the bundle of `program` (AGENT, ALLREDUCE) and its options."""
    return shipped_bundle(program) + json.dumps(options) + "\n"


def shipped_bundle(program: str) -> str:
    """The bundle alone, with its length line: the program is loaded once it has come, and then waits for its
    options line (the bootstrap imports it before it reads that line)."""
    with _BUNDLING:
        text = bundle(program)
    return f"{len(text.encode())}\n{text}"
