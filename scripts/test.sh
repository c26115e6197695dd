#!/usr/bin/env bash
# The whole test suite, as root on Debian: formatting, lints and the dependencies' licences,
# bans and sources (cargo deny); every release artifact built (scripts/dist.sh); unit, golden,
# kernel, traffic and image tests (cargo test); fuzzing (scripts/fuzz.sh) and a 2-minute soak
# (scripts/soak.sh); then the artifacts installed and run (scripts/test-dist.sh: the DEB under a
# real systemd, the RPM, the image). Kernel and traffic tests create their own network namespaces
# and need root; without root they fail loudly rather than skip.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" -ne 0 ]; then
    echo "test.sh: kernel, traffic and package tests need root (network namespaces, chroot, systemd-nspawn)" >&2
    exit 1
fi
scripts/setup.sh --dist
cargo fmt --check
cargo clippy --all-targets --all-features -- -D warnings
# The dependencies' licences, duplicates and sources (deny.toml; no advisories: their database is
# on GitHub, out of reach). cargo-deny reads every platform's crates, so they are fetched from
# crates.io first and the check itself runs offline.
cargo fetch --locked
cargo deny --offline --locked check licenses bans sources
scripts/dist.sh
cargo test --all-features
scripts/fuzz.sh 60
scripts/soak.sh 2
scripts/test-dist.sh
