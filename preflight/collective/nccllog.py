"""What NCCL says it chose, from the INFO lines a rank prints (NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=INIT,NET):
the network (IB, Socket, or a plugin such as IBext_v8), the HCAs it uses, and whether its channels go
through GPUDirect RDMA. Read here, on the head, from the lines each node's all-reduce worker sends
(preflight.node.allreduce keeps the few that name the network); COL003 judges the result."""
import re

VERSION = re.compile(r"NCCL INFO NCCL version (\S+)")
NETWORK = re.compile(r"NCCL INFO Using network (\S+)")
IB_DEVICES = re.compile(r"NCCL INFO NET/IB : Using (.*?)(?:;|$)")
CHANNEL = re.compile(r"NCCL INFO Channel \S+ : .* via (NET/[^/\s]+)(?:/\d+)?(/GDRDMA)?")
# Lines worth keeping as evidence: the few that say what was chosen and why.
KEPT = ("NCCL version", "Using network", "NET/IB :", "NET/Socket :", "NET/Plugin", "Plugin Path", "GPU Direct RDMA")
KEPT_LIMIT = 12


def summary(text: str) -> dict:
    """{"version", "network", "ib_devices", "channels" (NET/IB, NET/Socket, ...), "gdr" (True, False, None when
    no network channel was seen), "lines" (the telling ones)}; None values where NCCL did not say."""
    found = {"version": None, "network": None, "ib_devices": [], "channels": [], "gdr": None, "lines": []}
    gdr_channels = plain_channels = 0
    for line in text.splitlines():
        if "NCCL INFO" not in line:
            continue
        for pattern, key in ((VERSION, "version"), (NETWORK, "network")):
            match = pattern.search(line)
            if match and found[key] is None:
                found[key] = match.group(1)
        match = IB_DEVICES.search(line)
        if match and not found["ib_devices"]:
            found["ib_devices"] = re.findall(r"\[\d+\](\S+?:\d+)", match.group(1))
        match = CHANNEL.search(line)
        if match:
            if match.group(1) not in found["channels"]:
                found["channels"].append(match.group(1))
            gdr_channels += bool(match.group(2))
            plain_channels += not match.group(2)
        if any(k in line for k in KEPT) and len(found["lines"]) < KEPT_LIMIT and line.strip() not in found["lines"]:
            found["lines"].append(line.strip()[:300])
    if gdr_channels or plain_channels:
        found["gdr"] = gdr_channels > 0 and not plain_channels
    return found


def over_sockets(found: dict) -> bool:
    """NCCL moved data between nodes over TCP sockets."""
    return found.get("network") == "Socket" or "NET/Socket" in (found.get("channels") or [])
