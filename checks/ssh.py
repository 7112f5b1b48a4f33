"""SSH: every node can be reached with key authentication and no prompt."""
from __future__ import annotations

from typing import Iterator

from preflight.api import Finding, Status, check, node_error_check, skip

TRANSPORT_KINDS = {
    "unresolved": "name not resolved",
    "refused": "connection refused",
    "timeout": "timed out",
    "unreachable": "unreachable",
    "no-banner": "no SSH banner",
    "closed": "connection closed before the SSH banner",
    "handshake": "SSH handshake failed",
    "host-key-unknown": "unknown host key",
    "host-key-changed": "changed host key",
    "host-key": "host key not verifiable",
    "auth": "authentication failed",
    "protocol": "protocol error",
}


@check("SSH001", "ssh-reachable", "cluster", tags=["ssh", "network"])
def ssh_reachable(ctx) -> Iterator[Finding]:
    """Every node accepts an SSH connection with key authentication, without a prompt, within the timeout,
    and with a host key that matches known_hosts.

    The launcher (pdsh, DeepSpeed's runner, `preflight launch`) starts the job over SSH: a node that does not
    answer, asks for a password, or presents an unknown or changed key stops the launch or leaves the
    others waiting in the rendezvous.

    Follow the remediation for the reason given: start sshd, install the key, accept the host key once
    with `ssh`, or fix the name in ~/.ssh/config.
    """
    if not ctx.plan.remote:
        yield skip("this machine alone (no --hosts, --hostfile or --slurm): nothing to reach over SSH")
        return
    reached = []
    for node, state in ctx.facts.items():
        error = state.get("error")
        # Every way of not reaching a node is SSH001's, an unforeseen one too (srun's, a protocol error);
        # only an interpreter or collector that does not run is PKG003's.
        owner = node_error_check(error.get("kind")) if error is not None else None
        if error is None or owner == "PKG003":  # connected: the interpreter is what failed there
            reached.append(node)
            continue
        if owner != "SSH001":  # a budget spent before the node answered: an error of every check there
            continue
        label = TRANSPORT_KINDS.get(error.get("kind"), "not reached")
        yield Finding(Status.FAIL, f"{label}: {error.get('message')}", error.get("remediation"), nodes=(node,),
                      evidence={"reason": error.get("kind")})
    if reached:
        yield Finding(Status.PASS, "reached with key authentication", nodes=tuple(reached))
