#!/usr/bin/env bash
# Kernel benchmark: programs synthetic clusters of N services × M endpoints into fresh network
# namespaces and reports, for each size, in one run:
#   cold        nodeproxy --once into an empty namespace (wall time, kernel time, peak RSS)
#   re-apply    the same state again (reads the table back, sends nothing)
#   endpoint    one endpoint of one service replaced
#   service     one service added
#   nft -f      baseline: `nft -f` of the same ruleset (nodeproxy --dry-run output) into an
#               empty namespace
# Usage: sudo scripts/bench-kernel.sh [NxM ...]   (default: 1000x10 10000x10 50000x5 5000x50)
# Needs root (network namespaces), nft and GNU time; prints a Markdown table.
set -euo pipefail
cd "$(dirname "$0")/.."
sizes=("$@")
[ ${#sizes[@]} -gt 0 ] || sizes=(1000x10 10000x10 50000x5 5000x50)
command -v /usr/bin/time >/dev/null || { echo "install GNU time: apt-get install -y time" >&2; exit 1; }

cargo build --release --quiet --bin nodeproxy --example gen_cluster
bin=target/release/nodeproxy
gen=target/release/examples/gen_cluster
work=$(mktemp -d)
ns="npbench$$"
cleanup() {
    ip netns del "$ns-a" 2>/dev/null || true
    ip netns del "$ns-b" 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

args=(--hostname-override node-a --cluster-cidr 10.128.0.0/9)

# Runs nodeproxy --once in namespace $1 with input $2; prints "wall_s kernel_ms rss_kib msgs".
once() {
    local out
    out=$(/usr/bin/time -f "TIME %e %M" ip netns exec "$1" "$bin" --once --from-file "$2" "${args[@]}" 2>&1 | grep -v WARN)
    local wall rss kernel msgs
    wall=$(sed -n 's/^TIME \([0-9.]*\) .*/\1/p' <<<"$out")
    rss=$(sed -n 's/.*peak RSS \([0-9]*\) KiB.*/\1/p' <<<"$out")
    kernel=$(sed -n 's/.*kernel \([0-9.]*\) ms.*/\1/p' <<<"$out")
    msgs=$(sed -n 's/.* \([0-9]*\) message(s).*/\1/p' <<<"$out")
    echo "$wall $kernel $rss $msgs"
}

echo "| services × endpoints | elements | cold: wall / kernel / peak RSS | re-apply: wall | one endpoint: kernel (msgs) | one service: kernel (msgs) | nft -f: wall / peak RSS | cold speed-up vs nft -f |"
echo "|---|---|---|---|---|---|---|---|"
for size in "${sizes[@]}"; do
    n=${size%x*}
    m=${size#*x}
    "$gen" "$n" "$m" >"$work/base.json"
    "$gen" "$n" "$m" --change-endpoint >"$work/endpoint.json"
    "$gen" "$n" "$m" --change-endpoint --add-service >"$work/service.json"
    ip netns add "$ns-a"
    read -r cold_wall cold_kernel cold_rss _ < <(once "$ns-a" "$work/base.json")
    read -r re_wall _ _ _ < <(once "$ns-a" "$work/base.json")
    read -r _ ep_kernel _ ep_msgs < <(once "$ns-a" "$work/endpoint.json")
    read -r _ svc_kernel _ svc_msgs < <(once "$ns-a" "$work/service.json")
    elements=$(ip netns exec "$ns-a" "$bin" --dry-run --from-file "$work/base.json" "${args[@]}" 2>/dev/null \
        | tee "$work/base.nft" | grep -c ' comment "ns' || true)
    ip netns del "$ns-a"

    ip netns add "$ns-b"
    nft_out=$(/usr/bin/time -f "TIME %e %M" ip netns exec "$ns-b" nft -f "$work/base.nft" 2>&1)
    nft_wall=$(sed -n 's/^TIME \([0-9.]*\) .*/\1/p' <<<"$nft_out")
    nft_rss=$(sed -n 's/^TIME [0-9.]* \([0-9]*\)/\1/p' <<<"$nft_out")
    ip netns del "$ns-b"

    speedup=$(awk -v a="$nft_wall" -v b="$cold_wall" 'BEGIN { printf "%.1f×", a / b }')
    printf "| %s × %s | %s | %s s / %s ms / %s MiB | %s s | %s ms (%s) | %s ms (%s) | %s s / %s MiB | %s |\n" \
        "$n" "$m" "$elements" "$cold_wall" "$cold_kernel" "$((cold_rss / 1024))" "$re_wall" \
        "$ep_kernel" "$ep_msgs" "$svc_kernel" "$svc_msgs" "$nft_wall" "$((nft_rss / 1024))" "$speedup"
done
