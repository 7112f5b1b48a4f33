"""NCCL's environment rules, as NCCL reads its variables on a node: the environment with what NCCL's configuration
files add to it (nccl_env), which socket interfaces NCCL_SOCKET_IFNAME (and gloo's GLOO_SOCKET_IFNAME) select, which RDMA devices and ports NCCL_IB_HCA selects, NCCL_IB_DISABLE, the
RoCE GID entry NCCL_IB_GID_INDEX (or NCCL itself) picks; and the node's fabric facts these rules read. The
NET, RDMA, COL checks and the launch view all judge a node by these; no I/O here."""
from __future__ import annotations

import functools
import re
from typing import Any, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from preflight.inputs.numbers import int_or_none
from preflight.inputs.versions import requirement_name, version
from preflight.node.ncclconf import HOME_ENV_SINCE, merge, read_paths
from preflight.result import Finding, skip

IPV4_MAPPED = "0000:0000:0000:0000:0000:ffff:"


def fabric_of(facts: dict) -> Tuple[Optional[dict], Optional[Finding]]:
    """The node's fabric facts, or a skip that says why there are none. (Their shape is held to the
    collector's when they arrive: preflight.remote.shapes.)"""
    fabric = facts.get("fabric")
    if not isinstance(fabric, dict):
        return None, skip("these facts have no fabric section (a node running an older preflight)")
    if "error" in fabric:
        return None, skip(f"the fabric facts failed on the node: {fabric['error']}")
    return fabric, None


def env_integer(env: dict, name: str) -> Optional[int]:
    """An NCCL integer variable as NCCL reads it (strtoll): None when unset or not a number (NCCL then keeps
    its default and says so in a WARN line)."""
    return int_or_none(env.get(name, ""))


# --- NCCL's configuration files ---------------------------------------------------------------------

class NcclEnv(NamedTuple):
    """The variables as NCCL reads them in a process: its environment, then what NCCL's files add."""
    values: Mapping[str, str]
    sources: Mapping[str, str]  # name -> "PATH line N", for the values a file set
    unread: Tuple[str, ...]  # "PATH: why": files NCCL reads whose content is not known here

    def said(self, name: str) -> str:
        """`NAME=value`, and the file and line that set it where one did."""
        where = self.sources.get(name)
        return f"{name}={self.values.get(name)}" + (f" (from {where})" if where else "")


def nccl_env(facts: Mapping[str, Any], job_env: Optional[Mapping[str, str]] = None) -> NcclEnv:
    """The variables NCCL reads on this node: the node's environment with the job's own settings over it
    (`job_env`), then the NCCL_ lines of NCCL's configuration files for the variables still unset, as NCCL's
    initEnvFunc and setEnvFile do (src/misc/param.cc): the file NCCL_CONF_FILE names (since NCCL 2.23; else
    ~/.nccl.conf: the password database's home before 2.30, $HOME since), then /etc/nccl.conf, each line by
    setenv(name, value, 0), so the environment wins over the files, the first file over the second, and a file's
    first line for a name over its later ones (preflight.node.ncclconf.merge, which the census uses for a running
    rank too), by the rules of the node's NCCL (nccl_version; not known: what every release agrees on). The files
    as the node read them, the NCCL_CONF_FILE and HOME of the job's batch script among them: preflight.node.ncclconf."""
    env, conf = _environment(facts, job_env), facts.get("nccl_conf")
    files = conf.get("files") if isinstance(conf, dict) else None
    if not isinstance(files, dict):
        return NcclEnv(env, {}, ())  # facts from before the files were read
    named = env.get("NCCL_CONF_FILE")
    if (not named or named[:1023] in files) and not conf.get("later") and not any(
            f.get("entries") or not f.get("nothing", True) or f.get("cut_at") or f.get("long_lines")
            for f in files.values() if isinstance(f, dict)):
        return NcclEnv(env, {}, ())  # no file NCCL may read sets anything (nearly every node)
    return NcclEnv(*merge(env, conf, nccl_version(facts)))


def _environment(facts: Mapping[str, Any], job_env: Optional[Mapping[str, str]]) -> dict:
    """The node's environment, the batch script's NCCL_CONF_FILE and HOME the node was sent over it, then `job_env`."""
    env, conf = facts.get("env"), facts.get("nccl_conf")
    env = env if isinstance(env, dict) and "error" not in env else {}
    told = conf.get("job_env") if isinstance(conf, dict) else None
    env = dict(env, **told) if isinstance(told, dict) else env
    return dict(env, **job_env) if job_env else env


class Misread(NamedTuple):
    """A line of an NCCL configuration file that NCCL reads other than as written."""
    where: str  # "PATH line N"
    line: str  # the line as NCCL split it, NAME=value
    why: str
    fix: str


def misread_lines(facts: Mapping[str, Any], job_env: Optional[Mapping[str, str]] = None
                  ) -> Tuple[List[Misread], List[str], int]:
    """(the lines NCCL misreads in the files it reads on this node, what is not judged and why, how many NCCL_
    lines were read), as setEnvFile reads
    a line (src/misc/param.cc): split at the first `=`, nothing trimmed or unquoted, so `NCCL_X = y` sets `NCCL_X `,
    `export NCCL_X=y` sets `export NCCL_X` and `NCCL_X="y"` keeps the quotes; before NCCL 2.30 a CR at the line's
    end stays in the value. Only the files every NCCL release reads where the node's NCCL is not known; a CR then
    not judged."""
    conf = facts.get("nccl_conf")
    files = conf.get("files") if isinstance(conf, dict) else None
    if not isinstance(files, dict):
        return [], ["the node sent no NCCL configuration files (a node running an older preflight)"], 0
    release = nccl_version(facts)
    paths, why = read_paths(_environment(facts, job_env), conf, release)
    found, not_judged, lines = [], [why] if why else [], 0
    for path in paths:
        read = files.get(path)
        for entry in (read.get("entries") or ()) if isinstance(read, dict) else ():
            lines += 1
            name, value = entry.get("name"), entry.get("value")
            if not isinstance(name, str) or not isinstance(value, str):
                continue
            where, bare = f"{path} line {entry.get('line')}", name.strip(" \t")
            line = f"{name}={value}".replace("\r", "\\r")
            if bare.startswith("export") and bare[6:7] in (" ", "\t"):
                bare = bare[6:].strip(" \t")
                found.append(Misread(where, line, f"NCCL sets a variable named `{name}`, not {bare} (the file is no "
                                     "shell script)", f"write `{bare}={value.strip()}` without `export`"))
            elif bare != name:
                found.append(Misread(where, line, f"NCCL sets `{name}` with its spaces, not {bare}",
                                     f"write `{bare}={value.strip(' ')}` with no space around `=`"))
            elif len(value) > 1 and value[0] == value[-1] and value[0] in "\"'":
                found.append(Misread(where, line, f"NCCL keeps the quotes: {name} is {value}, quotes included",
                                     f"write `{name}={value[1:-1]}` without quotes"))
            elif value.endswith("\r") and release is None:
                not_judged.append(f"{where}: ends with a CR, which NCCL keeps before 2.30 (the node's NCCL is not known)")
            elif value.endswith("\r") and tuple(release[:2]) < HOME_ENV_SINCE:
                found.append(Misread(where, line, f"NCCL {'.'.join(map(str, release))} keeps the CR of the file's "
                                     "Windows line end in the value", f"`dos2unix {path}`"))
    return found, not_judged, lines


# --- socket interfaces ---------------------------------------------------------------------------

def interface_spec(env: Mapping[str, Any], name: str) -> Optional[str]:
    """NCCL_SOCKET_IFNAME or GLOO_SOCKET_IFNAME as NCCL and gloo read it: a value of one character or none is
    no selection at all (NCCL's ncclFindInterfaces and torch's ProcessGroupGloo both test `strlen(env) > 1`
    and otherwise pick their default interface), so `NCCL_SOCKET_IFNAME=` is the same as unset."""
    value = env.get(name)
    return value if isinstance(value, str) and len(value) > 1 else None


@functools.lru_cache(maxsize=256)  # the same value on thousands of nodes
def nccl_list(spec: str) -> Tuple[bool, bool, Tuple[Tuple[str, Optional[int]], ...]]:
    """A list variable as NCCL parses it (NCCL_SOCKET_IFNAME, NCCL_IB_HCA): (exclude `^`, exact `=`,
    ((name, port or None), ...)). parseStringList cuts each comma-separated item at `:` (the rest is its port)
    and drops empty items; without `=` each name is a prefix (mlx5 selects mlx5_0, mlx5_1, ...)."""
    spec = spec.strip(" \t")  # a CR stays: NCCL before 2.30 keeps a Windows line end of nccl.conf in the value
    exclude = spec.startswith("^")
    spec = spec[1:] if exclude else spec
    exact = spec.startswith("=")
    spec = spec[1:] if exact else spec
    entries = []
    for item in (p.strip(" \t") for p in spec.split(",")):
        name, colon, port = item.partition(":")
        if name.strip(" \t"):  # the port as atoi reads it: its leading digits, else 0
            digits = re.match(r"\s*[+-]?\d+", port)
            entries.append((name.strip(" \t"), (int(digits.group()) if digits else 0) if colon else None))
    return exclude, exact, tuple(entries)


def nccl_matches(name: str, port: Optional[int], exact: bool, entries: Sequence[Tuple[str, Optional[int]]]) -> bool:
    """NCCL's matchIfList: an empty list matches everything; a port given on either side must agree."""
    if not entries:
        return True
    return any((name == want if exact else name.startswith(want)) and (port is None or at is None or at == port)
               for want, at in entries)


def selected_interfaces(spec: str, names: List[str], nccl: bool) -> List[str]:
    """The interfaces NCCL (prefixes; `=` exact; `^` excludes; a `:port` suffix ignored) or gloo (exact names,
    comma-separated) would use."""
    if not nccl:
        wanted = {p.strip() for p in spec.split(",") if p.strip()}
        return [n for n in names if n in wanted]
    exclude, exact, entries = nccl_list(spec)
    return [n for n in names if nccl_matches(n, None, exact, entries) != exclude]


RUNNING_ONLY_SINCE = (2, 28, 3)  # NCCL skips interfaces without carrier (IFF_RUNNING), and sets virbr* apart
NCCL_DEFAULT_RULES = (("ib", "an ib* interface"), ("^docker,lo,virbr", "the first interface but docker*, lo and "
                      "virbr*"), ("docker", "a docker* interface"), ("lo", "loopback"), ("virbr", "a virbr* interface"))
NCCL_DEFAULT_RULES_BEFORE = (("ib", "an ib* interface"), ("^docker,lo", "the first interface but docker* and lo"),
                             ("docker", "a docker* interface"), ("lo", "loopback"))


def nccl_interfaces(facts: Mapping[str, Any], recent: Optional[bool] = None) -> Tuple[List[Tuple[str, str]], str]:
    """([(interface, the address NCCL uses there)] in NCCL's order, the rule that chose them), as NCCL's
    ncclFindInterfaces picks on this node (src/misc/socket.cc, src/os/linux.cc): NCCL_SOCKET_IFNAME when set,
    else the first rule that finds any: ib* interfaces, the subnet of NCCL_COMM_ID's address, every interface but
    docker*, lo and virbr* (virbr* only since NCCL 2.28.3), then docker*, lo, virbr*. It walks getifaddrs: the IPv4
    addresses by interface index, then the IPv6 ones (never ::1), one address per interface, NCCL_SOCKET_FAMILY
    AF_INET or AF_INET6 keeping one family; since NCCL 2.28.3 only interfaces with carrier (IFF_RUNNING). Its
    bootstrap, and so every rank's address for the others, is the first. `recent`: by NCCL 2.28.3's rules or the
    older ones (default: the node's NCCL's; its release not known: 2.28.3's, see choice_unknown)."""
    host, env = facts.get("host") or {}, nccl_env(facts).values
    interfaces, links = host.get("interfaces"), host.get("links")
    if not isinstance(interfaces, dict):
        return [], "the node's interfaces are not known"
    links = links if isinstance(links, dict) and "error" not in links else {}
    if recent is None:
        release = nccl_version(facts)
        recent = release is None or tuple(release[:3]) >= RUNNING_ONLY_SINCE
    family = {"AF_INET": 4, "AF_INET6": 6}.get(env.get("NCCL_SOCKET_FAMILY"))
    every = [(name, a) for wanted in (4, 6) for name, addresses in interfaces.items()  # getifaddrs' order
             if isinstance(addresses, list) for a in addresses if isinstance(a, str) and (":" in a) == (wanted == 6)]
    walk = [(name, a) for name, a in every  # the entries ncclOsFindInterfaces keeps
            if not (recent and (links.get(name) if isinstance(links.get(name), dict) else {}).get("running") is False)
            and a != "::1" and family in (None, 6 if ":" in a else 4)]

    def found(spec):
        exclude, exact, entries = nccl_list(spec)
        chosen = {}
        for name, address in walk:
            if nccl_matches(name, None, exact, entries) != exclude:
                chosen.setdefault(name, address)
        return list(chosen.items())

    spec = interface_spec(env, "NCCL_SOCKET_IFNAME")
    if spec is not None:
        return found(spec), f"NCCL_SOCKET_IFNAME={spec}"
    (ib, said), *rest = NCCL_DEFAULT_RULES if recent else NCCL_DEFAULT_RULES_BEFORE
    if found(ib):
        return found(ib), f"its default: {said}"
    comm_id = _comm_id_address(env.get("NCCL_COMM_ID"))
    # ncclFindInterfaceMatchSubnet walks every entry: no carrier or family test there
    same = [(n, a) for n, a in every if comm_id is not None and _in_subnet(links.get(n), a, comm_id)][:1]
    if same:
        return same, f"its default: the subnet of NCCL_COMM_ID ({comm_id})"
    for spec, said in rest:
        if found(spec):
            return found(spec), f"its default: {said}"
    return [], "its default finds no interface with an address"


def choice_unknown(facts: Mapping[str, Any]) -> Optional[str]:
    """Why the interface NCCL picks first on this node is not known, or None: its release is not known and NCCL
    2.28.3's rules (carrier, virbr* set apart) pick another than the older ones."""
    if nccl_version(facts) is not None:
        return None
    newer, older = (nccl_interfaces(facts, recent)[0] for recent in (True, False))
    if newer[:1] == older[:1]:
        return None
    first = [chosen[0][0] if chosen else "none" for chosen in (newer, older)]
    return (f"NCCL 2.28.3 and newer pick {first[0]}, older releases {first[1]} (interfaces without carrier, virbr*), "
            "and the node's NCCL release is not known")


def _comm_id_address(comm_id: Any):
    """NCCL_COMM_ID's address ("10.0.0.1:29500", "[fe80::1]:29500"), or None."""
    import ipaddress

    if not isinstance(comm_id, str) or len(comm_id) < 2:
        return None
    host = comm_id[1:].split("]", 1)[0] if comm_id.startswith("[") else comm_id.rsplit(":", 1)[0]
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None  # a name: NCCL resolves it; not judged here


def _in_subnet(link: Any, address: str, target) -> bool:
    """Whether `address` of this interface (with its prefix in the link's facts) holds `target`."""
    import ipaddress

    entries = (link.get("ipv4") or []) + (link.get("ipv6") or []) if isinstance(link, dict) else []
    for entry in entries:
        if isinstance(entry, str) and entry.split("/", 1)[0] == address:
            try:
                return target in ipaddress.ip_interface(entry).network
            except ValueError:
                return False
    return False


def socket_interface(facts: Mapping[str, Any]) -> Optional[str]:
    """The interface NCCL's socket transport (with GPUs) or gloo (without) binds on this node, and its address,
    as they pick it: NCCL's first (nccl_interfaces), or gloo's GLOO_SOCKET_IFNAME when set, else the address the
    hostname resolves to."""
    host, env = facts.get("host") or {}, facts.get("env") or {}
    nccl = nccl_env(facts).values
    interfaces = host.get("interfaces") or {}
    if not isinstance(interfaces, dict):
        return None
    if (facts.get("gpus") or {}).get("available"):
        if choice_unknown(facts):
            return None
        chosen, rule = nccl_interfaces(facts)
        spec = interface_spec(nccl, "NCCL_SOCKET_IFNAME")
        return f"{chosen[0][0]} {chosen[0][1]}" if chosen else (f"none matches {spec}" if spec else None)
    usable = [n for n, addrs in interfaces.items() if isinstance(addrs, list) and addrs]
    spec = interface_spec(env, "GLOO_SOCKET_IFNAME")
    if spec is not None:
        chosen = selected_interfaces(spec, usable, False)
        return f"{chosen[0]} {interfaces[chosen[0]][0]}" if chosen else f"none matches {spec}"
    resolved = host.get("resolves_to")
    if isinstance(resolved, list) and resolved:
        owner = next((n for n in usable if resolved[0] in interfaces[n]), None)
        return f"{owner or '?'} {resolved[0]}"
    return None


# --- RDMA devices and ports ----------------------------------------------------------------------

def ib_disabled(env: dict) -> bool:
    return bool(env_integer(env, "NCCL_IB_DISABLE"))


def selected_ports(env: dict, devices: dict) -> List[Tuple[str, str, dict]]:
    """(device, port, facts) of the ports NCCL may use: those NCCL_IB_HCA selects (net_ib.cc keeps a port
    when matchIfList(device, port) differs from `^`), every port when it is unset or empty."""
    spec = env.get("NCCL_IB_HCA")
    ports = [(d, p, facts) for d in sorted(devices) for p, facts in sorted((devices[d].get("ports") or {}).items())]
    if not isinstance(spec, str):
        return ports
    exclude, exact, entries = nccl_list(spec)
    return [(d, p, f) for d, p, f in ports if nccl_matches(d, int_or_none(p), exact, entries) != exclude]


def rdma_devices_nccl_may_use(facts: dict) -> list:
    """The node's HCAs with a port NCCL may use (NCCL_IB_HCA, NCCL_IB_DISABLE), from its fabric facts."""
    fabric, missing = fabric_of(facts)
    env = nccl_env(facts).values
    if missing or ib_disabled(env):
        return []
    return sorted({device for device, _, _ in selected_ports(env, fabric.get("rdma") or {})})


# --- RoCE GIDs -----------------------------------------------------------------------------------

def gid_kind(entry: dict) -> Tuple[str, str]:
    """(RoCE version, address family) of a GID table entry: ("RoCE v2", "IPv4"), ("IB/RoCE v1", "link-local")."""
    gid = str(entry.get("gid", "")).lower()
    family = "IPv4" if gid.startswith(IPV4_MAPPED) else "link-local" if gid.startswith("fe8") else "IPv6"
    return str(entry.get("type") or "unknown type"), family


# NCCL_IB_GID_INDEX defaults to -1 (NCCL chooses, ncclIbGetGidIndex) since NCCL 2.21; before, to 0.
GID_CHOICE_SINCE = (2, 21)


def nccl_wheel(facts: dict) -> Tuple[Optional[str], Optional[str]]:
    """(the nvidia-nccl wheel torch's metadata requires (its Requires-Dist) or None, the version of the NCCL the
    node's torch loads: that wheel's, else the nvidia-nccl wheel installed, else None)."""
    def mapping(value):  # a section a node sent in another shape is read as empty
        return value if isinstance(value, dict) else {}

    packages = mapping(facts.get("packages"))
    torch = mapping(packages.get("requires")).get("torch")
    wheel = next((n for n in map(requirement_name, torch if isinstance(torch, list) else [])
                  if n.startswith("nvidia-nccl-")), None)
    installed = mapping(packages.get("distributions"))
    return wheel, (installed.get(wheel) if wheel else None) or mapping(packages.get("versions")).get("nccl")


def nccl_version(facts: dict) -> Optional[Tuple[int, ...]]:
    """The release of the NCCL the node's torch loads (nccl_wheel), None where it is not known."""
    text = nccl_wheel(facts)[1]
    found = version(text) if isinstance(text, str) else None
    return found.release if found else None


def used_gid(env: dict, port: dict, nccl: Optional[Tuple[int, ...]] = None) -> Tuple[Optional[int], Optional[dict], str]:
    """(index, the entry NCCL uses on this port or None, how it was chosen). With NCCL 2.21 or newer (or
    `nccl` unknown) a negative or unset NCCL_IB_GID_INDEX lets NCCL choose: the first entry of
    NCCL_IB_ROCE_VERSION_NUM (default 2) in NCCL_IB_ADDR_FAMILY (default AF_INET); an older NCCL uses index 0
    when it is unset and fails to query a negative one."""
    gids = {g["index"]: g for g in port.get("gids") or [] if isinstance(g, dict) and isinstance(g.get("index"), int)}
    index = env_integer(env, "NCCL_IB_GID_INDEX")
    if index is not None and index >= 0:
        return index, gids.get(index), f"NCCL_IB_GID_INDEX={index}"
    if nccl is not None and tuple(nccl[:2]) < GID_CHOICE_SINCE:
        release = ".".join(map(str, nccl))
        if index is None:
            return 0, gids.get(0), f"NCCL_IB_GID_INDEX unset: NCCL {release} uses index 0"
        return index, None, f"NCCL {release} chooses no GID itself (NCCL 2.21 and newer do)"
    version = "RoCE v2" if env_integer(env, "NCCL_IB_ROCE_VERSION_NUM") in (None, 2) else "IB/RoCE v1"
    family = "IPv6" if str(env.get("NCCL_IB_ADDR_FAMILY", "")).strip() == "AF_INET6" else "IPv4"
    for i in sorted(gids):
        kind = gid_kind(gids[i])
        if kind[0] == version and (kind[1] == family or (family == "IPv6" and kind[1] == "link-local")):
            return i, gids[i], f"NCCL's choice ({version}, {family})"
    return None, None, f"NCCL's choice ({version}, {family})"


# --- multi-node NVLink (MNNVL) ----------------------------------------------------------------------

STRTOLL = re.compile(r"\s*([+-]?)(0[xX][0-9a-fA-F]+|[1-9][0-9]*|0[0-7]*)?")
INT64 = 1 << 63


def strtoll(text: str) -> Optional[int]:
    """strtoll(text, NULL, 0) as NCCL calls it, without looking where the number ends: the leading number (decimal,
    0x hexadecimal, 0 octal), 0 where there is none; None out of int64's range (errno ERANGE)."""
    sign, digits = STRTOLL.match(text).groups()
    if not digits:
        return 0
    value = int(digits, 16 if digits[1:2] in ("x", "X") else 8 if digits.startswith("0") else 10)
    value = -value if sign == "-" else value
    return value if -INT64 <= value < INT64 else None


def nccl_param(env: Mapping[str, Any], name: str, default: int) -> int:
    """An NCCL_PARAM as ncclLoadParam reads it (src/misc/param.cc): unset or empty is the default, else strtoll
    (text that is no number is 0, and out of range the default)."""
    text = env.get(name)
    if not isinstance(text, str) or not text:
        return default
    value = strtoll(text)
    return default if value is None else value


def p2p_level_zero(env: Mapping[str, Any]) -> Optional[str]:
    """The variable that sets NCCL's P2P level to LOC (0), as ncclGetLevel reads them (src/graph/paths.cc):
    NCCL_P2P_DISABLE=1 first, else NCCL_P2P_LEVEL=LOC or an old-style number 0; None where neither does."""
    disable = env.get("NCCL_P2P_DISABLE")
    if isinstance(disable, str) and strtoll(disable) == 1:
        return f"NCCL_P2P_DISABLE={disable}"
    level = env.get("NCCL_P2P_LEVEL")
    if isinstance(level, str) and (level == "LOC" or (level[:1].isdigit() and strtoll(level) == 0)):
        return f"NCCL_P2P_LEVEL={level}"
    return None


MNNVL_P2P_GATE_SINCE = (2, 27)  # NCCL 2.27.3 added `p2pLevel != 0` to the condition below


def mnnvl_off(env: Mapping[str, Any], nccl: Optional[Tuple[int, ...]] = None) -> Optional[str]:
    """Why NCCL, in a job of several nodes, does not try multi-node NVLink with this environment, or None where it
    does (as far as the environment goes). src/init.cc, initTransportsRank: it checks MNNVL when
    `(nNodes > 1 && NCCL_MNNVL_ENABLE != 0 && p2pLevel != 0) || NCCL_MNNVL_ENABLE == 1` (NCCL_MNNVL_ENABLE
    defaults to 2; the P2P level since NCCL 2.27); src/mnnvl.cc, ncclMnnvlCheck: only with cuMem on
    (src/misc/cudawrap.cc, ncclCuMemEnable: NCCL_CUMEM_ENABLE above 0, or unset (-2) where CUDA has it; 0 and any
    other negative value turn it off). `nccl`: the release the node's torch loads, None where not known."""
    enable = nccl_param(env, "NCCL_MNNVL_ENABLE", 2)
    if enable == 0:
        return f"NCCL_MNNVL_ENABLE={env.get('NCCL_MNNVL_ENABLE')} turns multi-node NVLink off"
    p2p = p2p_level_zero(env)
    if p2p and enable != 1 and (nccl is None or tuple(nccl[:2]) >= MNNVL_P2P_GATE_SINCE):
        return f"{p2p} turns multi-node NVLink off (NCCL_MNNVL_ENABLE is not 1)"
    cumem = nccl_param(env, "NCCL_CUMEM_ENABLE", -2)
    if cumem <= 0 and cumem != -2:
        return f"NCCL_CUMEM_ENABLE={env.get('NCCL_CUMEM_ENABLE')} turns cuMem off, and multi-node NVLink with it"
    return None


# --- once per node --------------------------------------------------------------------------------

def nccl_env_of(ctx, node: Optional[str] = None) -> NcclEnv:
    """nccl_env of a node's facts, once per node and run: NET005, PKG004 and the RDMA checks ask it of every node
    (five times). `ctx`: the node's context, or the cluster's and `node`. Callers do not change what it returns (nor
    the facts). Not with the job's settings: nccl_env then copies the node's environment, and a copy kept for each
    of 16,384 nodes would cost megabytes to save JOB012 and GPU010 one call a node."""
    on = ctx if node is None else ctx.on_node[node]
    return on.memo(nccl_env, lambda: nccl_env(on.fact))
