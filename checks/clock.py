"""CLK: clocks of the nodes against the head's, and the kernel's view of their discipline."""
from __future__ import annotations

from typing import Iterator

from preflight.api import Finding, Status, cause_of, check, skip, warn


@check("CLK001", "clock-skew", "cluster", tags=["clock"])
def clock_skew(ctx) -> Iterator[Finding]:
    """Each node's clock is within the limits of the head's (defaults: warn at 100 ms, fail at 1 s),
    measured NTP-style over the open connection: several samples, the one with the smallest round trip.

    Skewed clocks break what compares timestamps across nodes: NCCL and torch.distributed timeouts fire
    early or late, Kerberos and TLS certificates are refused, logs and profiles cannot be lined up, and
    checkpoints are judged stale or new.

    Run chrony or ntpd on every node against the same servers (`chronyc tracking` shows the offset);
    adjust the limits with --clock-warn / --clock-fail.
    """
    if not ctx.plan.remote:
        yield skip("this machine alone: no other clock to compare")
        return
    head = ctx.plan.head
    head_clock = ctx.facts.get(head, {}).get("clock")
    if not head_clock:
        yield skip(f"the head {head} was not reached", blocked_by=cause_of(ctx, head))
        return
    limits = ctx.plan.limits
    within, worst = [], 0.0
    for node in ctx.reachable:
        clock = ctx.facts[node].get("clock")
        if node == head or not clock:
            continue
        offset = clock["offset_s"] - head_clock["offset_s"]
        bound = clock["bound_s"] + head_clock["bound_s"]
        evidence = {"offset_s": offset, "bound_s": bound}
        text = f"clock is {offset:+.3f} s (± {bound * 1000:.1f} ms) from the head {head}'s"
        if abs(offset) - bound > limits.clock_fail_s:
            yield Finding(Status.FAIL, f"{text}, over the {limits.clock_fail_s:g} s limit",
                          "synchronise this node's clock (chrony/ntpd) with the head's time source", nodes=(node,),
                          evidence=evidence)
        elif abs(offset) - bound > limits.clock_warn_s:
            yield Finding(Status.WARN, f"{text}, over the {limits.clock_warn_s:g} s warning limit",
                          "check time synchronisation on this node (`chronyc tracking`)", nodes=(node,),
                          evidence=evidence)
        else:
            within.append(node)
            worst = max(worst, abs(offset), key=abs)
    if within:
        yield Finding(Status.PASS, f"clocks within {limits.clock_warn_s:g} s of the head {head}'s",
                      nodes=tuple(within), evidence={"offset_s": worst, "bound_s": head_clock["bound_s"]})


@check("CLK002", "clock-synchronised", "node", tags=["clock"],
       reads=["clock.error", "clock.synchronised", "clock.maxerror_s", "clock.esterror_s"])
def clock_synchronised(ctx) -> Iterator[Finding]:
    """The kernel reports the node's clock as synchronised (adjtimex: not STA_UNSYNC).

    A clock that no time daemon disciplines drifts by seconds a day, so a job that starts with clocks in
    agreement may not finish with them.

    Run chrony (or ntpd, systemd-timesyncd) on the node and check `timedatectl` says 'System clock
    synchronized: yes'.
    """
    clock = ctx.fact.get("clock", {})
    if "error" in clock:
        yield skip(f"adjtimex unavailable: {clock['error']}")
    elif not clock.get("synchronised"):
        yield warn(f"the kernel reports the clock unsynchronised (max error {clock.get('maxerror_s', 0):.1f} s)",
                   "start chrony or ntpd on this node", maxerror_s=clock.get("maxerror_s"))
    else:
        yield Finding(Status.PASS, f"synchronised (estimated error {clock.get('esterror_s', 0) * 1000:.1f} ms)",
                      evidence={"esterror_s": clock.get("esterror_s")})


@check("CLK003", "ntp-offset", "cluster", tags=["clock", "ntp"])
def ntp_offset(ctx) -> Iterator[Finding]:
    """With --ntp-server, each node's absolute clock offset (against that NTP server) is within the limits.

    Clocks that agree with each other can still all be wrong together: certificates, tokens with expiry
    times and object-store signatures then fail on every node at once.

    Point chrony or ntpd on every node at a reachable time source (`chronyc sources`), or pass the
    --ntp-server the cluster really uses.
    """
    ntp = (ctx.probes or {}).get("ntp")
    if ntp is None:
        yield skip("no --ntp-server given")
        return
    if "error" in ntp:
        yield Finding(Status.ERROR, f"cannot query the NTP server {ntp['server']}: {ntp['error']}",
                      "check the server's name, that it serves NTP (UDP 123), and the network to it")
        return
    limits, within, worst = ctx.plan.limits, [], 0.0
    for node in ctx.reachable:
        clock = ctx.facts[node].get("clock")
        if not clock:
            continue
        offset = clock["offset_s"] - ntp["offset_s"]  # node minus NTP
        bound = clock["bound_s"] + ntp["bound_s"]
        evidence = {"offset_s": offset, "bound_s": bound, "ntp_server": ntp["server"]}
        text = f"clock is {offset:+.3f} s (± {bound * 1000:.1f} ms) from NTP server {ntp['server']}"
        if abs(offset) - bound > limits.clock_fail_s:
            yield Finding(Status.FAIL, f"{text}, over {limits.clock_fail_s:g} s", "synchronise the clock with chrony/ntpd",
                          nodes=(node,), evidence=evidence)
        elif abs(offset) - bound > limits.clock_warn_s:
            yield Finding(Status.WARN, f"{text}, over {limits.clock_warn_s:g} s", "check time synchronisation",
                          nodes=(node,), evidence=evidence)
        else:
            within.append(node)
            worst = max(worst, abs(offset))
    if within:
        yield Finding(Status.PASS, f"within {limits.clock_warn_s:g} s of NTP server {ntp['server']}",
                      nodes=tuple(within), evidence={"offset_s": worst, "bound_s": ntp["bound_s"]})
