#!/usr/bin/env bash
# Fuzzes the parsers with cargo fuzz (libFuzzer): scripts/fuzz.sh [SECONDS] [TARGET...]
#   file_reader     --from-file bytes (YAML and JSON) -> model -> ruleset -> rendering
#   netlink_decode  kernel replies: netlink framing, acks, attributes, elements, expressions
#   sync_diff       state sequences: diff(a, b) applied to a is b; incremental equals full
# Each target runs SECONDS (default 60, the CI run; `scripts/fuzz.sh 3600` is the long run)
# from its seeds in fuzz/corpus/<target> plus what earlier runs found (target/fuzz-corpus/,
# not committed), with a 2 GiB memory limit. A crash, a panic or the limit fails the run;
# libFuzzer writes the input to fuzz/artifacts/<target>/, and it becomes a test case.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
seconds=${1:-60}
[ $# -gt 0 ] && shift
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(file_reader netlink_decode sync_diff)
if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "fuzz.sh: cargo-fuzz is missing; scripts/setup.sh --dist installs it" >&2
    exit 1
fi
# cargo fuzz passes flags only nightly accepts; these machines have one toolchain, stable, which
# takes them with RUSTC_BOOTSTRAP. No sanitizer: the code is safe Rust, and a panic aborts.
export RUSTC_BOOTSTRAP=1
for target in "${targets[@]}"; do
    found=../target/fuzz-corpus/$target
    mkdir -p "$found"
    log=../target/fuzz-$target.log
    if ! cargo fuzz run --sanitizer none -O "$target" "$found" "corpus/$target" -- \
        -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
        > "$log" 2>&1; then
        tail -n 40 "$log" >&2
        echo "fuzz.sh: $target failed; the input is in fuzz/artifacts/$target/" >&2
        exit 1
    fi
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
    per_second=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -n 1)
    coverage=$(grep -o 'cov: [0-9]* ft: [0-9]*' "$log" | tail -n 1)
    echo "fuzz: $target: ${seconds}s, ${runs} runs, ${per_second} exec/s, ${coverage}, corpus $(ls "$found" | wc -l) found + $(ls "corpus/$target" | wc -l) seeds"
done
