#!/usr/bin/env bash
# The whole test suite: formatting, lints, unit, golden, kernel and traffic tests. Kernel and
# traffic tests create their own network namespaces and need root; without root they fail
# loudly rather than skip.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
if [ "$(id -u)" -ne 0 ]; then
    echo "test.sh: kernel and traffic tests need root (network namespaces); run with sudo" >&2
    exit 1
fi
cargo fmt --check
cargo clippy --all-targets -- -D warnings
cargo test --all-features
