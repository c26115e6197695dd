#!/usr/bin/env bash
# Installs what building nodeproxy needs (gcc and make: the C parts of ring and jemalloc) and
# what its tests use: nft (the test oracle: every rendering must be accepted by
# `nft -c` and list back identically), iproute2 (network namespaces, veth), socat (endpoint
# servers and clients in traffic tests) and conntrack (the reconciler tests compare with
# `conntrack -L`), kmod (modprobe nf_conntrack, for the node set-up test). nodeproxy itself needs
# none of them at run time.
#
# With --dist, also what scripts/dist.sh and scripts/test-dist.sh use: objcopy (binutils), python3 (the OCI image writer), cargo-deb and
# cargo-generate-rpm (the packages), and the tools that test the artifacts: debootstrap and
# systemd-nspawn (a Debian root booted under a real systemd), lintian, rpm and rpmlint, umoci and
# skopeo (the image), cargo-fuzz (scripts/fuzz.sh) and cargo-deny (scripts/test.sh's licence,
# ban and source check of the dependencies, deny.toml).
set -euo pipefail
# `cmd | grep -q` under pipefail fails when grep exits at the first match and cmd dies of
# SIGPIPE; plain grep reads all of its input.
matches() { grep "$@" > /dev/null; }
dist=false
[ "${1:-}" = "--dist" ] && dist=true

need=()
command -v gcc >/dev/null 2>&1 || need+=(gcc)
command -v make >/dev/null 2>&1 || need+=(make)
command -v nft >/dev/null 2>&1 || need+=(nftables)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
command -v socat >/dev/null 2>&1 || need+=(socat)
command -v unshare >/dev/null 2>&1 || need+=(util-linux)
command -v ping >/dev/null 2>&1 || need+=(iputils-ping)
command -v conntrack >/dev/null 2>&1 || need+=(conntrack)
command -v modprobe >/dev/null 2>&1 || need+=(kmod)
if $dist; then
    command -v objcopy >/dev/null 2>&1 || need+=(binutils)
    command -v python3 >/dev/null 2>&1 || need+=(python3)
    command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
    command -v systemd-nspawn >/dev/null 2>&1 || need+=(systemd-container)
    command -v lintian >/dev/null 2>&1 || need+=(lintian)
    command -v rpm >/dev/null 2>&1 || need+=(rpm)
    command -v rpmlint >/dev/null 2>&1 || need+=(rpmlint)
    command -v umoci >/dev/null 2>&1 || need+=(umoci)
    command -v skopeo >/dev/null 2>&1 || need+=(skopeo)
fi
if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "setup: missing ${need[*]}; run as root (or: sudo apt-get install -y ${need[*]})" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${need[@]}"
fi
if $dist; then
    # Pinned: the packages' layout is tested against these versions.
    cargo deb --version 2>/dev/null | matches -x 'cargo-deb 3.8.0' \
        || cargo install --locked --quiet cargo-deb@3.8.0
    cargo generate-rpm --version 2>/dev/null | matches -x 'cargo-generate-rpm 0.21.1' \
        || cargo install --locked --quiet cargo-generate-rpm@0.21.1
    # The fuzzer (scripts/fuzz.sh); libFuzzer's C++ is built by its crate with g++.
    command -v g++ >/dev/null 2>&1 || { apt-get install -y -qq g++; }
    cargo fuzz --version 2>/dev/null | matches -x 'cargo-fuzz 0.13.2' \
        || cargo install --locked --quiet cargo-fuzz@0.13.2
    # Pinned: deny.toml's keys are this version's. Built from source: about 3 minutes on 2 cores.
    cargo deny --version 2>/dev/null | matches -x 'cargo-deny 0.20.2' \
        || cargo install --locked --quiet cargo-deny@0.20.2
fi
