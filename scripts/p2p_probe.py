"""GPU peer-to-peer on this machine, every ordered pair of GPUs, through torch: whether CUDA says the pair can
access each other (cudaDeviceCanAccessPeer), then a copy of SIZE bytes from one to the other, verified on the
receiving GPU, and its bandwidth. Each copy is bounded (--timeout for the whole probe): a pair that hangs (a
broken P2P path: ACS redirecting, IOMMU translating, a driver with a P2P defect) is reported as such, and the
probe goes on with the next. Prints one JSON document; exit 0 when every pair copied correctly, 1 when one did
not, 2 when there is nothing to probe (torch without CUDA, fewer than two GPUs).

    python scripts/p2p_probe.py [--size-mib 64] [--timeout 60]   # run by scripts/device_gpu_check.sh
"""
import argparse
import json
import os
import sys
import threading
import time


def copy_pair(torch, src, dst, numel, result):
    try:
        a = torch.arange(numel, dtype=torch.int32, device=f"cuda:{src}")
        torch.cuda.synchronize(src)
        started = time.perf_counter()
        b = a.to(f"cuda:{dst}")
        torch.cuda.synchronize(dst)
        seconds = time.perf_counter() - started
        expected = torch.arange(numel, dtype=torch.int32, device=f"cuda:{dst}")
        result.update(ok=bool(torch.equal(b, expected)), seconds=seconds,
                      gbps=round(numel * 4 / seconds / 1e9, 2) if seconds > 0 else None)
    except Exception as exc:  # a CUDA error on this pair: said, the others still probed
        result.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:300])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError as exc:
        print(json.dumps({"probed": False, "reason": f"torch is not importable: {exc}"}))
        return 2
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        print(json.dumps({"probed": False, "reason": f"{count} CUDA GPU(s) here: no pair to probe"}))
        return 2
    count, numel = torch.cuda.device_count(), args.size_mib * (1 << 20) // 4
    deadline = time.monotonic() + args.timeout
    pairs = []
    for src in range(count):
        for dst in range(count):
            if src == dst:
                continue
            entry = {"src": src, "dst": dst, "can_access_peer": bool(torch.cuda.can_device_access_peer(src, dst))}
            pairs.append(entry)
            left = deadline - time.monotonic()
            if left <= 0:
                entry.update(ok=None, error="not probed: the probe's time was spent")
                continue
            worker = threading.Thread(target=copy_pair, args=(torch, src, dst, numel, entry), daemon=True)
            worker.start()
            worker.join(min(left, 10.0))
            if worker.is_alive():  # a hung copy: the process ends with the daemon thread still in it
                entry.update(ok=False, error="the copy did not finish within 10 s: peer-to-peer hangs")
                break
    doc = {"probed": True, "gpus": count, "size_mib": args.size_mib, "names": [torch.cuda.get_device_name(i)
                                                                             for i in range(count)], "pairs": pairs}
    print(json.dumps(doc, indent=1), flush=True)
    if any("hangs" in (p.get("error") or "") for p in pairs):
        os._exit(1)  # the hung copy's thread would hold the interpreter's exit in CUDA's teardown
    return 0 if all(p.get("ok") for p in pairs) else 1


if __name__ == "__main__":
    sys.exit(main())
