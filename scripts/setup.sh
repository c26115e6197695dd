#!/usr/bin/env bash
# Installs the system packages nodeproxy's tests use: nft (the test oracle: every rendering must
# be accepted by `nft -c` and list back identically), iproute2 (network namespaces, veth), socat
# (endpoint servers and clients in traffic tests) and conntrack (the reconciler tests compare
# with `conntrack -L`). nodeproxy itself needs none of them.
set -euo pipefail
need=()
command -v nft >/dev/null 2>&1 || need+=(nftables)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
command -v socat >/dev/null 2>&1 || need+=(socat)
command -v unshare >/dev/null 2>&1 || need+=(util-linux)
command -v ping >/dev/null 2>&1 || need+=(iputils-ping)
command -v conntrack >/dev/null 2>&1 || need+=(conntrack)
if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "setup: missing ${need[*]}; run as root (or: sudo apt-get install -y ${need[*]})" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${need[@]}"
fi
