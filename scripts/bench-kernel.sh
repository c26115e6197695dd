#!/usr/bin/env bash
# Kernel and memory benchmark: programs synthetic clusters of N services × M endpoints into fresh
# network namespaces and reports, for each size, in one run:
#   cold        nodeproxy --once into an empty namespace (wall time, kernel time, peak RSS)
#   re-apply    the same state again: adoption of existing tables (sends nothing); sealed (the
#               previous run's seal holds: elements not read back) and unsealed (seal deleted
#               first: everything read back)
#   endpoint    one endpoint of one service replaced
#   service     one service added
#   nft -f      baseline: `nft -f` of the same ruleset (nodeproxy --dry-run output) into an
#               empty namespace
#   daemon      benches/daemon.rs at the same size (fake API server, private namespace): VmRSS
#               after churn, VmHWM, and the lower + diff time of its two-slice syncs
# then, per size, each of issue 11's targets beside what was measured, and a TSV of every figure
# for scripts/plot-performance.py.
# Usage (as root): scripts/bench-kernel.sh [--no-daemon] [--binary FILE] [--tsv FILE] [NxM ...]
#        (default sizes: 1000x10 10000x10 50000x5; TSV: target/bench-kernel.tsv)
# --binary runs that nodeproxy (--once, --dry-run and the daemon) instead of this checkout's
# release build: the shipped one, dist/nodeproxy-<version>-<target> from scripts/dist.sh, is
# linked statically with whole-program LTO, and its pages of code are part of the daemon's
# VmRSS (docs/performance.md, "The binary's pages").
# Needs root (network namespaces), nft and GNU time; prints Markdown tables. It reports; it
# never fails on a figure.
set -euo pipefail
cd "$(dirname "$0")/.."
daemon=true
binary=
tsv=target/bench-kernel.tsv
sizes=()
while [ $# -gt 0 ]; do
    case "$1" in
        --no-daemon) daemon=false ;;
        --tsv) tsv=$2; shift ;;
        --binary) binary=$2; shift ;;
        *) sizes+=("$1") ;;
    esac
    shift
done
[ ${#sizes[@]} -gt 0 ] || sizes=(1000x10 10000x10 50000x5)
command -v /usr/bin/time >/dev/null || { echo "install GNU time: apt-get install -y time" >&2; exit 1; }

cargo build --release --quiet --bin nodeproxy --example gen_cluster
bin=${binary:-target/release/nodeproxy}
[ -x "$bin" ] || { echo "no nodeproxy binary at $bin" >&2; exit 1; }
bin=$(realpath "$bin")
echo "nodeproxy: $bin ($("$bin" --version 2>/dev/null | head -n 1))"
echo
gen=target/release/examples/gen_cluster
daemon_bench=
if $daemon; then
    daemon_bench=$(cargo bench --quiet --bench daemon --no-run --message-format=json 2>/dev/null \
        | grep '"kind":\["bench"\],[^}]*"name":"daemon"' \
        | sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -n 1)
    [ -x "$daemon_bench" ] || { echo "could not build benches/daemon.rs" >&2; exit 1; }
fi
work=$(mktemp -d)
ns="npbench$$"
cleanup() {
    ip netns del "$ns-a" 2>/dev/null || true
    ip netns del "$ns-b" 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

args=(--hostname-override node-a --cluster-cidr 10.128.0.0/9)

# Seconds since $1 (from `date +%s%N`), to the millisecond: GNU time's %e has two decimals.
since() { awk -v a="$1" -v b="$(date +%s%N)" 'BEGIN { printf "%.3f", (b - a) / 1e9 }'; }

# Runs nodeproxy --once in namespace $1 with input $2; prints "wall_s kernel_ms rss_kib msgs".
once() {
    local out t0 wall rss kernel msgs
    t0=$(date +%s%N)
    out=$(/usr/bin/time -f "TIME %e %M" ip netns exec "$1" "$bin" --once --from-file "$2" "${args[@]}" 2>&1 | grep -v WARN)
    wall=$(since "$t0")
    rss=$(sed -n 's/.*peak RSS \([0-9]*\) KiB.*/\1/p' <<<"$out")
    kernel=$(sed -n 's/.*kernel \([0-9.]*\) ms.*/\1/p' <<<"$out")
    msgs=$(sed -n 's/.* \([0-9]*\) message(s).*/\1/p' <<<"$out")
    echo "$wall $kernel $rss $msgs"
}

# KiB to whole MiB, rounded as the targets table rounds them.
mib() { awk -v k="$1" 'BEGIN { printf "%.0f", k / 1024 }'; }

# One size's figures beside issue 11's targets.
targets() {
    local n=$1 m=$2 wall=$3 kernel=$4 rss=$5 re=$6 nft=$7 d_rss=$8 d_hwm=$9 two=${10}
    # The adoption target: 0.3 s up to 10k services, 1 s at 50k.
    local adopt=0.3
    [ "$n" -ge 50000 ] && adopt=1
    awk -v n="$n" -v m="$m" -v wall="$wall" -v kernel="$kernel" -v rss="$rss" -v re="$re" \
        -v nft="$nft" -v drss="$d_rss" -v dhwm="$d_hwm" -v two="$two" -v adopt="$adopt" '
    function verdict(ok) { return ok ? "met" : "**missed**" }
    function row(what, measured, target, ok, have) {
        printf "| %s | %s | %s | %s |\n", what, measured, target, have ? verdict(ok) : "-"
    }
    BEGIN {
        printf "\n%s × %s\n\n| | measured | target | |\n|---|---|---|---|\n", n, m
        row("daemon VmRSS after churn", drss == "-" ? "-" : sprintf("%.0f MiB", drss / 1024), "≤ 40 MiB", drss / 1024 <= 40, drss != "-")
        row("daemon VmHWM (start-up sync)", dhwm == "-" ? "-" : sprintf("%.0f MiB", dhwm / 1024), "≤ 64 MiB", dhwm / 1024 <= 64, dhwm != "-")
        r = wall / (kernel / 1000)
        row("`--once` cold: wall / kernel", sprintf("%.2f s / %.3f s (%.1f×)", wall, kernel / 1000, r), "≤ 1.3×", r <= 1.3, 1)
        row("`--once` cold: peak RSS", sprintf("%.0f MiB", rss / 1024), "≤ 48 MiB", rss / 1024 <= 48, 1)
        row("adoption (re-apply, nothing to change)", sprintf("%.2f s", re), sprintf("≤ %s s", adopt), re <= adopt, 1)
        s = nft / wall
        row("cold vs `nft -f`", sprintf("%.1f× (%.2f s vs %.2f s)", s, wall, nft), "≥ 4×", s >= 4, 1)
        row("two-slice sync, lower + diff (daemon log, p50)", two == "-" ? "-" : sprintf("%.2f ms", two), "≤ 1 ms", two <= 1, two != "-")
    }'
}

mkdir -p "$(dirname "$tsv")"
printf 'services\tendpoints\telements\tcold_wall_s\tcold_kernel_ms\tcold_rss_kib\treapply_wall_s\tnft_wall_s\tnft_rss_kib\tdaemon_rss_kib\tdaemon_hwm_kib\ttwo_slice_ms\treapply_unsealed_wall_s\n' >"$tsv"
: >"$work/targets.md"
echo "| services × endpoints | elements | cold: wall / kernel / peak RSS | re-apply: wall, sealed / unsealed | one endpoint: kernel (msgs) | one service: kernel (msgs) | nft -f: wall / peak RSS | cold speed-up vs nft -f |"
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
    ip netns exec "$ns-a" nft delete table ip nodeproxy-seal
    read -r re_unsealed _ _ _ < <(once "$ns-a" "$work/base.json")
    read -r _ ep_kernel _ ep_msgs < <(once "$ns-a" "$work/endpoint.json")
    read -r _ svc_kernel _ svc_msgs < <(once "$ns-a" "$work/service.json")
    # Every element of both tables: one per comma in an `elements = { … }` block, plus one per
    # block (no comment, key or value contains a comma).
    elements=$(ip netns exec "$ns-a" "$bin" --dry-run --from-file "$work/base.json" "${args[@]}" 2>/dev/null \
        | tee "$work/base.nft" \
        | awk '/elements = \{/ { inb = 1 } inb { n += gsub(/,/, ",") } inb && /\}/ { n++; inb = 0 } END { print n + 0 }')
    ip netns del "$ns-a"

    ip netns add "$ns-b"
    t0=$(date +%s%N)
    nft_out=$(/usr/bin/time -f "TIME %e %M" ip netns exec "$ns-b" nft -f "$work/base.nft" 2>&1)
    nft_wall=$(since "$t0")
    nft_rss=$(sed -n 's/^TIME [0-9.]* \([0-9]*\)/\1/p' <<<"$nft_out")
    ip netns del "$ns-b"

    # The daemon at the same size (its own namespace, its own fake API server).
    d_rss=- d_hwm=- d_two=-
    if $daemon; then
        NP_BINARY=$bin NP_SERVICES=$n NP_ENDPOINTS=$m NP_MONITOR=0 NP_IDLE_UPDATES=20 NP_PAIR_UPDATES=30 NP_CHURN_SECONDS=10 \
            "$daemon_bench" --bench >"$work/daemon.out" 2>&1 \
            || { cat "$work/daemon.out" >&2; echo "benches/daemon.rs failed at $size" >&2; exit 1; }
        result=$(sed -n 's/^RESULT //p' "$work/daemon.out")
        d_rss=$(sed -n 's/.*daemon_rss_kib=\([0-9]*\).*/\1/p' <<<"$result")
        d_hwm=$(sed -n 's/.*daemon_hwm_kib=\([0-9]*\).*/\1/p' <<<"$result")
        d_two=$(sed -n 's/.*two_slice_ms=\([0-9.]*\).*/\1/p' <<<"$result")
    fi
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$n" "$m" "$elements" "$cold_wall" \
        "$cold_kernel" "$cold_rss" "$re_wall" "$nft_wall" "$nft_rss" "$d_rss" "$d_hwm" "$d_two" "$re_unsealed" >>"$tsv"
    targets "$n" "$m" "$cold_wall" "$cold_kernel" "$cold_rss" "$re_wall" "$nft_wall" "$d_rss" "$d_hwm" "$d_two" \
        >>"$work/targets.md"

    speedup=$(awk -v a="$nft_wall" -v b="$cold_wall" 'BEGIN { printf "%.1f×", a / b }')
    printf "| %s × %s | %s | %s s / %s ms / %s MiB | %s s / %s s | %s ms (%s) | %s ms (%s) | %s s / %s MiB | %s |\n" \
        "$n" "$m" "$elements" "$cold_wall" "$cold_kernel" "$(mib "$cold_rss")" "$re_wall" "$re_unsealed" \
        "$ep_kernel" "$ep_msgs" "$svc_kernel" "$svc_msgs" "$nft_wall" "$(mib "$nft_rss")" "$speedup"
done

echo
echo "Issue 11's targets (\"met\" or \"missed\"; \"-\" where not measured):"
cat "$work/targets.md"
echo
echo "every figure: $tsv (plot: scripts/plot-performance.py $tsv out.svg)"
