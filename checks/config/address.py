"""CFG main process address: with several machines, main_process_ip and main_process_port are set, and are a
host the workers can reach and a port."""
from __future__ import annotations

import ipaddress
import re
from typing import Iterator

from preflight.api import Finding, check, fail, skip, warn
from preflight.checks.config.common import accel_doc, at, command_unknown, from_shell
from preflight.inputs.configs import accelerate_launcher
from preflight.inputs.documents import shorten
from preflight.inputs.launchcmd import DEFAULT_PORT
from preflight.inputs.numbers import is_int, text_number

HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9_]([A-Za-z0-9_-]{0,62})(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,62}))*\.?$")

# Addresses written as a stand-in for the head's real one (documentation and templates).
PLACEHOLDER_IP = re.compile(r"^(x{1,3}(\.x{1,3}){3}|<[^>]*>|\{\{.*\}\}|your[_-]?\w*|ip[_-]?addr(ess)?|ip[0-9]*|"
                            r"main[_-]?(process[_-]?)?ip|master[_-]?(addr|ip)|head[_-]?ip|changeme|0\.0\.0\.0)$", re.I)


@check("CFG010", "main-process-address", "config", tags=["accelerate", "multinode", "network"])
def main_process_address(ctx) -> Iterator[Finding]:
    """With several machines, main_process_ip and main_process_port are set, and are a host and a port.

    Every worker connects to the head at this address to rendezvous: without it accelerate stops with
    an assertion; with `user@host`, a URL or `host:port` in main_process_ip the workers wait until the
    rendezvous times out; a port above 65535 cannot be bound, one under 1024 needs root, and 0 (any
    free port) is picked by each machine on its own. On one machine torchrun reads only the port, and one
    process alone neither: a bad value there is a warning.

    Set main_process_ip to the head's address or host name as the workers resolve it (no user, scheme
    or port) and main_process_port to a free port above 1024, such as 29500.
    """
    doc = accel_doc(ctx)
    if doc is None:
        yield skip("no accelerate config given (--config)")
        return
    data = doc.data
    machines = text_number(data.get("num_machines", 1))
    launcher = "simple" if ctx.plan.accelerate.cpu else accelerate_launcher(data.get("distributed_type"))
    # DeepSpeed's runner on the head is given no address for an empty one (utils/launch.py: `if main_process_ip:`)
    runner_finds_ip = ctx.plan.accelerate.head_runner and data.get("main_process_ip") in (None, "")
    if is_int(machines) and machines > 1:
        if runner_finds_ip:
            yield warn(f"{doc.where('main_process_ip')}: num_machines is {machines} and main_process_ip is "
                       f"{'empty' if data.get('main_process_ip') == '' else 'not set'}: "
                       "DeepSpeed's runner meets at the first address `hostname -I` prints on the first host, "
                       "which may not be on the training network", f"set {doc.setting('main_process_ip')} to the "
                       "head node's address on the training network", **at(doc, "main_process_ip"))
        elif data.get("main_process_ip") is None and command_unknown(ctx):
            yield skip(f"{doc.where('main_process_ip')}: num_machines is {machines} and main_process_ip is not in the "
                       "file: the launch command must give --main_process_ip (not judged without it)",
                       **at(doc, "main_process_ip"))
        elif data.get("main_process_ip") is None:
            yield fail(f"{doc.where('main_process_ip')}: num_machines is {machines} but main_process_ip is not set; "
                       "the workers cannot find the head" + (" ('When using multiple machines, you need to specify "
                       "the main process IP')" if launcher == "simple" else ""),
                       _head_fix(ctx, doc.setting("main_process_ip")), **at(doc, "main_process_ip"))
        if data.get("main_process_port") is None and not command_unknown(ctx):  # else the command may give it
            # The torchrun and DeepSpeed launches fall back to DEFAULT_PORT; the simple one asserts (utils/launch.py)
            simple_one = launcher == "simple"
            yield (fail if simple_one else warn)(
                f"{doc.where('main_process_port')}: num_machines is {machines} but main_process_port is not set; "
                + ("accelerate launch stops with 'you need to specify the main process port'" if simple_one else
                   f"accelerate falls back to {DEFAULT_PORT}"),
                f"set {doc.setting('main_process_port')} to {DEFAULT_PORT} (or another free port)",
                **at(doc, "main_process_port"))
    ip = data.get("main_process_ip")
    several = is_int(machines) and machines > 1
    # On one machine only some launches read the head's address and port (accelerate/utils/launch.py): torchrun
    # (which DEEPSPEED also runs there) reads the port alone; MULTI_CPU's processes meet through MASTER_ADDR and
    # MASTER_PORT when there are several; 'NO', --cpu and XLA start one process that meets no one.
    procs = text_number(data.get("num_processes"))
    cpu_group = launcher == "simple" and data.get("distributed_type") == "MULTI_CPU" and is_int(procs) and procs > 1
    ip_read = several or cpu_group
    port_read = several or cpu_group or launcher in ("torchrun", "deepspeed")
    unread = "unused on one machine by this launch, but the workers cannot reach the head once num_machines grows"
    wildcard = isinstance(ip, str) and ip.strip() == "0.0.0.0"
    # Without the launch command, its --main_process_ip may replace what the file says: a warning at most.
    ip_read = ip_read and not command_unknown(ctx)
    unread = unread if not command_unknown(ctx) else "unless the launch command gives --main_process_ip, the " \
        "workers cannot reach the head at it"
    if isinstance(ip, str) and PLACEHOLDER_IP.match(ip.strip()) and (several or not wildcard):
        why = ("0.0.0.0 is the address a server listens on, not one a worker on another machine can connect to"
               if wildcard else "it is a placeholder from a template, not an address")
        yield (fail if ip_read else warn)(
            f"{doc.where('main_process_ip')}: main_process_ip is {ip!r}: {why}; "
            + ("the workers cannot reach the head and wait until the rendezvous times out" if ip_read and several
               else "the processes cannot reach the rendezvous address" if ip_read else unread),
            _head_fix(ctx, doc.setting("main_process_ip")), value=ip, **at(doc, "main_process_ip"))
    elif isinstance(ip, str) and not _is_host(ip) and not runner_finds_ip and not from_shell(ip):  # run time
        yield (fail if ip_read else warn)(
            f"{doc.where('main_process_ip')}: main_process_ip is {ip!r}, expected a host name or an IP address; "
            + ("accelerate passes it on unchecked, and the workers cannot reach the head at it" if ip_read else unread),
            _host_fix(ctx, ip, doc.setting("main_process_ip")), value=ip, **at(doc, "main_process_ip"))
    port = text_number(data.get("main_process_port"))
    if isinstance(port, str) and not from_shell(port):  # not a number ('PORT1'); numbers as text are CFG003's
        yield (fail if port_read else warn)(
            f"{doc.where('main_process_port')}: main_process_port is {shorten(port)}, expected a port number"
            + ("; the launcher stops on it" if port_read else "; unused on one machine by this launch"),
            f"set {doc.setting('main_process_port')} to {DEFAULT_PORT} (or another free port)", value=port,
            **at(doc, "main_process_port"))
    elif is_int(port):
        if port == 0:  # accelerate launch picks a free port: fine on one machine, not agreed on between several
            if is_int(machines) and machines > 1:
                yield warn(f"{doc.where('main_process_port')}: main_process_port is 0 with {machines} machines: "
                           "accelerate picks a free port on each machine, and only a launcher that starts every "
                           "node from the head (DeepSpeed's pdsh) passes that port on to the others",
                           f"set {doc.setting('main_process_port')} to {DEFAULT_PORT} (or another port free on the head)",
                           value=port, **at(doc, "main_process_port"))
        elif not 1 <= port <= 65535:
            yield (fail if port_read else warn)(
                f"{doc.where('main_process_port')}: main_process_port is {port}, expected 1-65535"
                + ("" if port_read else "; unused on one machine by this launch"),
                f"set {doc.setting('main_process_port')} to {DEFAULT_PORT}", value=port, **at(doc, "main_process_port"))
        elif port < 1024:
            yield warn(f"{doc.where('main_process_port')}: main_process_port is {port}, a privileged port under 1024 "
                       "that only root may bind", f"use a port above 1024, such as {DEFAULT_PORT}", value=port,
                       **at(doc, "main_process_port"))


def _is_host(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        # Digits and dots only is a mistyped IPv4 address ('10.0.0.256', '1234'), not a host name: the
        # resolver reads '1234' as the address 0.0.4.210.
        return bool(HOSTNAME.match(text)) and not re.fullmatch(r"[0-9.]+", text)


def _head_fix(ctx, name: str) -> str:
    """The fix for a main_process_ip that is missing or no address: the head as the nodes or the hostfile name it (the
    first of them: DeepSpeed's runner makes the hostfile's first host rank 0), else the node with machine_rank 0;
    never an address made up for the example."""
    head = source = None
    if ctx.plan.remote and ctx.plan.nodes:
        head, source = ctx.plan.nodes[0], "the head of the nodes checked"
    elif ctx.plan.hostfile is not None:
        head, source = ctx.plan.hostfile.hosts[0], f"the first host of {ctx.plan.hostfile.path}"
    if head is not None:
        return (f"set {name} to the head node's address as the workers resolve it: {head!r} ({source}), or its "
                "address on the training network (`hostname -I` there)")
    return (f"set {name} to the head node's (machine_rank 0) address as the workers resolve it: `hostname -I` on the "
            "head, or its host name")


def _host_fix(ctx, ip: str, name: str) -> str:
    """The address inside what was written, when there is a valid one: never the invalid value itself."""
    host = _host_part(ip)
    if host and host != ip and _is_host(host) and not PLACEHOLDER_IP.match(host):
        return f"set {name} to {host!r} (no user@, scheme, path or :port)"
    return _head_fix(ctx, name) + "; no user@, scheme, path or :port"


def _host_part(text: str) -> str:
    """TEXT without a scheme, user@, path or :port; empty when nothing is left."""
    text = re.sub(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", "", text.strip())
    text = text.split("/")[0].split("@")[-1]
    if text.count(":") == 1:
        text = text.split(":")[0]
    return text.strip("[]")
