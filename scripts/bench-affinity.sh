#!/usr/bin/env bash
# Kernel cost of ClientIP affinity and loadBalancerSourceRanges at 10k services × 5 endpoints:
# every 10th service gets sessionAffinity ClientIP (a third of those a 60 s timeout) and every
# 10th a LoadBalancer IP with two source ranges. Reports nodeproxy --once kernel time for a cold
# load and for adding one affinity service, with and without the features; with them, also for
# replacing the first endpoint of an affinity service (its slot is refilled at once) and for
# removing the first endpoint of two affinity services and adding it back. Then one Service with
# 20,000 endpoints (issue 12: its affinity must cost what it costs without): cold load and adding
# one endpoint, with and without affinity.
# Usage: scripts/bench-affinity.sh [nodeproxy args, e.g. --nodeport-addresses all]
# (as root: network namespaces; python3). Builds into $CARGO_TARGET_DIR when set.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet --bin nodeproxy --example gen_cluster
target="${CARGO_TARGET_DIR:-target}"
bin="$target/release/nodeproxy"
gen="$target/release/examples/gen_cluster"
work=$(mktemp -d)
ns="npaff$$"
trap 'ip netns del "$ns" 2>/dev/null || true; rm -rf "$work"' EXIT
args=(--hostname-override node-a --cluster-cidr 10.128.0.0/9 "$@")
"$gen" 10000 5 >"$work/plain.json"
"$gen" 10000 5 --add-service >"$work/plain-add.json"
"$gen" 10000 5 --change-endpoint >"$work/plain-change.json"
decorate() {
    python3 - "$1" "$2" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
i = 0
for item in doc["items"]:
    if item.get("kind") != "Service":
        continue
    spec = item["spec"]
    if i % 10 == 0 or i == 10000:
        spec["sessionAffinity"] = "ClientIP"
        if i % 30 == 0:
            spec["sessionAffinityConfig"] = {"clientIP": {"timeoutSeconds": 60}}
    if i % 10 == 5:
        spec["type"] = "LoadBalancer"
        spec["loadBalancerSourceRanges"] = ["192.0.2.0/24", "198.51.100.%d/32" % (i % 250)]
        item.setdefault("status", {})["loadBalancer"] = {"ingress": [{"ip": "203.0.%d.%d" % (i // 250 % 250, i % 250 + 1)}]}
    i += 1
json.dump(doc, open(sys.argv[2], "w"))
PY
}
decorate "$work/plain.json" "$work/feat.json"
decorate "$work/plain-add.json" "$work/feat-add.json"
decorate "$work/plain-change.json" "$work/feat-change.json"
# Services 0 and 10 have affinity: drop their first endpoint.
python3 - "$work/feat.json" "$work/feat-minus.json" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
for item in doc["items"]:
    if item.get("kind") == "EndpointSlice" and item["metadata"]["name"] in ("svc0-abcde", "svc10-abcde"):
        item["endpoints"] = item["endpoints"][1:]
json.dump(doc, open(sys.argv[2], "w"))
PY
once() {
    ip netns exec "$ns" "$bin" --once --from-file "$1" "${args[@]}" 2>&1 | grep synced \
        | sed -n 's/.* \([0-9]*\) message(s).*kernel \([0-9.]*\) ms.*/\2 ms (\1 msgs)/p'
}
for variant in plain feat; do
    ip netns add "$ns"
    cold=$(once "$work/$variant.json")
    add=$(once "$work/$variant-add.json")
    nft_s=$( { ip netns exec "$ns" "$bin" --dry-run --from-file "$work/$variant.json" "${args[@]}" 2>/dev/null >"$work/$variant.nft"; ip netns del "$ns"; ip netns add "$ns"; /usr/bin/time -f "%e" ip netns exec "$ns" nft -f "$work/$variant.nft"; } 2>&1 | tail -1)
    ip netns del "$ns"
    echo "| $variant | cold: $cold | add one service: $add | nft -f cold: ${nft_s} s |"
done
ip netns add "$ns"
once "$work/feat.json" >/dev/null
change=$(once "$work/feat-change.json")
once "$work/feat.json" >/dev/null
minus=$(once "$work/feat-minus.json")
back=$(once "$work/feat.json")
ip netns del "$ns"
echo "| feat | replace an affinity service's first endpoint: $change | remove the first endpoint of two: $minus | add them back: $back |"

# One Service, 20,000 endpoints (and 20,001: one added), without and with affinity.
"$gen" 1 20000 >"$work/big.json"
"$gen" 1 20001 >"$work/big-add.json"
python3 - "$work" <<'PY'
import json, sys
for name in ("big", "big-add"):
    doc = json.load(open(f"{sys.argv[1]}/{name}.json"))
    for item in doc["items"]:
        if item.get("kind") == "Service":
            item["spec"]["sessionAffinity"] = "ClientIP"
    json.dump(doc, open(f"{sys.argv[1]}/{name}-aff.json", "w"))
PY
for variant in big big-aff; do
    ip netns add "$ns"
    cold=$(once "$work/$variant.json")
    add=$(once "$work/${variant/big/big-add}.json")
    ip netns del "$ns"
    echo "| $variant (1 service, 20000 endpoints) | cold: $cold | add one endpoint: $add |"
done
