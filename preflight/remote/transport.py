"""The transports that reach a node, chosen by name, behind one interface (as ClusterShell's workers are).

    connection = transport.connect("ssh" | "srun" | "local", node, options)   # connected, or NodeError
    process = connection.start(command, stdin_text, timeout)        # preflight.remote.shipping's command
    process.read_line(timeout); process.send_line(text); process.stderr_tail(); process.exit_status(timeout)
    process.close(); connection.close()

"ssh" reaches any node: by the system's OpenSSH client (preflight.remote.openssh), or by paramiko
(preflight.remote.ssh) where no `ssh` is installed or --ssh paramiko asks; "srun" (preflight.remote.srun) runs a job step on a node of a
SLURM allocation; "local" (preflight.remote.local) runs it on this machine, for an interpreter other than
preflight's own (with preflight's own, gather runs the collector in-process).
Everything a node does is bounded: a NodeError (preflight.remote.session) says why a node could not be reached, answered late, or sent
what no program of preflight.node sends.
"""
from __future__ import annotations

NAMES = ("ssh", "srun", "local")
SSH_CLIENTS = ("openssh", "paramiko")


def client(options) -> str:
    """The SSH client: --ssh's, else the system's OpenSSH where `ssh` is installed, else paramiko."""
    chosen = getattr(options, "ssh_client", None)
    if chosen:
        return chosen
    from preflight.remote import openssh

    return "openssh" if openssh.available() else "paramiko"


def connect(name: str, node: str, options, handshaken=None, wait: bool = False):
    """A connection to `node` over the transport `name`, connected. options: timeout, and for ssh ssh_config and
    accept_new, for srun slurm_job (a GatherOptions). handshaken (ssh): called once the key exchange is done and
    the host key verified, before authentication. wait (ssh): the node reached before this returns (OpenSSH
    otherwise reaches it with the first program)."""
    if name == "local":  # this machine: node is its name
        from preflight.remote.local import LocalConnection

        return LocalConnection(options.timeout).connect()
    if name == "srun":
        from preflight.remote.srun import SrunConnection

        return SrunConnection(node, options.timeout, options.slurm_job).connect()
    if name == "ssh" and client(options) == "openssh":
        from preflight.remote.openssh import OpenSSHConnection

        return OpenSSHConnection(node, options.timeout, options.accept_new, options.ssh_config).connect(handshaken,
                                                                                                       wait)
    if name == "ssh":
        from preflight.remote.ssh import SSHConnection, load_ssh_settings

        settings = load_ssh_settings(node, options.ssh_config)
        return SSHConnection(settings, options.timeout, options.accept_new, options.ssh_config).connect(
            handshaken=handshaken)
    raise ValueError(f"no transport {name!r}: one of {', '.join(NAMES)}")
