#!/usr/bin/env python3
"""Measures the kernel cost of candidate ruleset layouts for N services x M endpoints.

Each layout is generated as nft text and loaded with `nft -f` into a fresh network namespace
(cold load), then one service's endpoints are changed with a small incremental `nft -f` (the
operations that layout needs for it). Layouts:

  upstream-1.35  per-service chain + anonymous `numgen ... vmap` + per-endpoint chains
  upstream-1.36  per-service chain + anonymous `numgen ... map` DNAT (no endpoint chains)
  data-driven    nodeproxy's layout: static chains, every service/endpoint a map element

Usage: sudo scripts/bench-layouts.py N M [layout ...]   Needs root, nft, ip, strace.
Prints one Markdown table row per layout.
"""

import ipaddress
import os
import subprocess
import sys
import tempfile
import time


def ip(base, i):
    return str(ipaddress.IPv4Address(base + i))


SVC_BASE = int(ipaddress.IPv4Address("10.96.0.1"))
EP_BASE = int(ipaddress.IPv4Address("10.128.0.0"))


def common_head():
    return [
        "table ip bench {",
        "  map service-ips { type ipv4_addr . inet_proto . inet_service : verdict; }",
        "  chain nat-prerouting { type nat hook prerouting priority dstnat; policy accept;"
        " ip daddr . meta l4proto . th dport vmap @service-ips; }",
    ]


def upstream_135(n, m):
    out = common_head()
    elems = []
    for s in range(n):
        eps = [ip(EP_BASE, s * m + e) for e in range(m)]
        vm = ", ".join(f"{e} : goto ep-{s}-{e}" for e in range(m))
        out.append(f"  chain svc-{s} {{ numgen random mod {m} vmap {{ {vm} }}; }}")
        for e, addr in enumerate(eps):
            out.append(f"  chain ep-{s}-{e} {{ meta l4proto tcp dnat to {addr}:8080; }}")
        elems.append(f"{ip(SVC_BASE, s)} . tcp . 80 : goto svc-{s}")
    out.append("}")
    out.append("add element ip bench service-ips { " + ", ".join(elems) + " }")
    return "\n".join(out) + "\n"


def upstream_135_change(n, m):
    # Service 0 gets a new endpoint in slot 0: new endpoint chain, service chain rewritten.
    vm = ", ".join(f"{e} : goto ep-0-{e}" for e in range(1, m))
    vm = f"0 : goto ep-0-new, {vm}" if vm else "0 : goto ep-0-new"
    return (
        "add chain ip bench ep-0-new\n"
        "add rule ip bench ep-0-new meta l4proto tcp dnat to 10.255.255.254:8080\n"
        "flush chain ip bench svc-0\n"
        f"add rule ip bench svc-0 numgen random mod {m} vmap {{ {vm} }}\n"
    )


def upstream_136(n, m):
    out = common_head()
    elems = []
    for s in range(n):
        mp = ", ".join(f"{e} : {ip(EP_BASE, s * m + e)} . 8080" for e in range(m))
        out.append(
            f"  chain svc-{s} {{ meta l4proto tcp dnat ip to numgen random mod {m} map {{ {mp} }}; }}"
        )
        elems.append(f"{ip(SVC_BASE, s)} . tcp . 80 : goto svc-{s}")
    out.append("}")
    out.append("add element ip bench service-ips { " + ", ".join(elems) + " }")
    return "\n".join(out) + "\n"


def upstream_136_change(n, m):
    mp = ", ".join(
        f"{e} : {'10.255.255.254' if e == 0 else ip(EP_BASE, e)} . 8080" for e in range(m)
    )
    return (
        "flush chain ip bench svc-0\n"
        f"add rule ip bench svc-0 meta l4proto tcp dnat ip to numgen random mod {m} map {{ {mp} }}\n"
    )


def data_driven(n, m):
    out = common_head()
    out.append(
        f"  map pick-{m}-endpoints {{ typeof ip daddr . meta l4proto . th dport . numgen random mod {m}"
        " : ip daddr . th dport; }"
    )
    out.append(
        f"  chain pick-{m} {{ dnat ip to ip daddr . meta l4proto . th dport . numgen random mod {m}"
        f" map @pick-{m}-endpoints; }}"
    )
    out.append("}")
    svc, eps = [], []
    for s in range(n):
        vip = ip(SVC_BASE, s)
        svc.append(f"{vip} . tcp . 80 : goto pick-{m}")
        for e in range(m):
            eps.append(f"{vip} . tcp . 80 . {e} : {ip(EP_BASE, s * m + e)} . 8080")
    out.append("add element ip bench service-ips { " + ", ".join(svc) + " }")
    # nft parses huge element lists slowly in one statement; chunk them like a real loader.
    for i in range(0, len(eps), 5000):
        out.append(f"add element ip bench pick-{m}-endpoints {{ " + ", ".join(eps[i : i + 5000]) + " }")
    return "\n".join(out) + "\n"


def data_driven_change(n, m):
    vip = ip(SVC_BASE, 0)
    return (
        f"delete element ip bench pick-{m}-endpoints {{ {vip} . tcp . 80 . 0 }}\n"
        f"add element ip bench pick-{m}-endpoints {{ {vip} . tcp . 80 . 0 : 10.255.255.254 . 8080 }}\n"
    )


LAYOUTS = {
    "upstream-1.35": (upstream_135, upstream_135_change),
    "upstream-1.36": (upstream_136, upstream_136_change),
    "data-driven": (data_driven, data_driven_change),
}


def nft_f(ns, path):
    t = time.monotonic()
    subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", path], check=True)
    return time.monotonic() - t


def kernel_time(ns, path):
    """Seconds the kernel spent in nft's batch: the transaction is processed synchronously
    inside the sendmsg that carries it, so strace's time for that call is the kernel's cost."""
    out = subprocess.run(
        ["ip", "netns", "exec", ns, "strace", "-T", "-e", "trace=sendmsg", "nft", "-f", path],
        check=True,
        capture_output=True,
        text=True,
    ).stderr
    times = [float(line.rsplit("<", 1)[1].rstrip(">")) for line in out.splitlines()
             if line.startswith("sendmsg") and line.endswith(">")]
    return max(times, default=0.0)


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    n, m = int(sys.argv[1]), int(sys.argv[2])
    layouts = sys.argv[3:] or list(LAYOUTS)
    ns = f"nplayout{os.getpid()}"
    print("| layout | services × endpoints | cold `nft -f` (wall) | one endpoint changed (kernel) |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as d:
        for name in layouts:
            full, change = LAYOUTS[name]
            base, delta = os.path.join(d, "base.nft"), os.path.join(d, "delta.nft")
            with open(base, "w") as f:
                f.write(full(n, m))
            with open(delta, "w") as f:
                f.write(change(n, m))
            subprocess.run(["ip", "netns", "add", ns], check=True)
            try:
                cold = nft_f(ns, base)
                inc = kernel_time(ns, delta)
            finally:
                subprocess.run(["ip", "netns", "del", ns], check=False)
            print(f"| {name} | {n} × {m} | {cold:.2f} s | {inc * 1000:.2f} ms |")


if __name__ == "__main__":
    main()
