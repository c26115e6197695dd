#!/usr/bin/env bash
# The soak (benches/soak.rs): the daemon against the fake API server at 10k Services for MINUTES
# (default 30) under endpoint churn, Services coming and going, watch drops, API outages,
# `nft flush ruleset` and elements deleted by hand, with a client connecting throughout. Fails
# when the kernel does not converge within one sync period after a disturbance, when a client
# connection fails while our rules are in place, or when RSS or descriptors grow. Writes
# target/soak/samples.csv and target/soak/soak.svg. Needs root (its own network namespace).
# CI runs `scripts/soak.sh 2`; docs/reliability.md reports the 30-minute run.
set -euo pipefail
cd "$(dirname "$0")/.."
minutes=${1:-30}
NP_SOAK_MINUTES=$minutes cargo bench --bench soak
