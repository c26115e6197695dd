#!/usr/bin/env bash
# Builds every release artifact into dist/: the static binary (stripped) and its debug info,
# the DEB, the RPM, the OCI image archive, the Kubernetes manifest and SHA256SUMS.
#
#   scripts/dist.sh [TARGET]        TARGET defaults to x86_64-unknown-linux-gnu
#
# Needs what scripts/setup.sh --dist installs (cargo-deb, cargo-generate-rpm, objcopy, python3).
# Reproducible: two runs from the same commit give byte-identical files (SOURCE_DATE_EPOCH from
# the commit, paths remapped, sorted archives with fixed owners and times); scripts/test-dist.sh
# checks it. For another target (arm64: aarch64-unknown-linux-gnu) see docs/packaging.md.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

target=${1:-x86_64-unknown-linux-gnu}
case "$target" in
    x86_64-*) deb_arch=amd64 rpm_arch=x86_64 oci_arch=amd64 ;;
    aarch64-*) deb_arch=arm64 rpm_arch=aarch64 oci_arch=arm64 ;;
    *) echo "dist: no package architecture known for $target" >&2; exit 2 ;;
esac
objcopy=${OBJCOPY:-objcopy}
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -n 1)
commit=$(git rev-parse --short=12 HEAD 2>/dev/null || echo "${NODEPROXY_GIT_COMMIT:-unknown}")
export NODEPROXY_GIT_COMMIT=$commit
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || echo 0)}
if [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then
    echo "dist: warning: the work tree has uncommitted changes; the artifacts are not those of $commit" >&2
fi

# Static glibc build. Paths of this checkout and of the cargo home are remapped, in Rust and in
# the C dependencies (ring, jemalloc), so the binary does not depend on where it was built.
cargo_home=${CARGO_HOME:-$HOME/.cargo}
remap="--remap-path-prefix=$root=/build/nodeproxy --remap-path-prefix=$cargo_home=/cargo"
export RUSTFLAGS="-C target-feature=+crt-static $remap"
cflags="-ffile-prefix-map=$root=/build/nodeproxy -ffile-prefix-map=$cargo_home=/cargo"
export CFLAGS="${CFLAGS:+$CFLAGS }$cflags"
cargo build --locked --profile dist --target "$target"
built=target/$target/dist/nodeproxy

stage=target/dist-stage
rm -rf "$stage" dist
mkdir -p "$stage" dist
# The shipped binary is stripped; its debug info (line tables) goes beside it, linked by
# .gnu_debuglink so debuggers find it.
debug=nodeproxy-$version-$target.debug
"$objcopy" --only-keep-debug "$built" "$stage/$debug"
"$objcopy" --strip-all --remove-section=.comment --add-gnu-debuglink="$stage/$debug" "$built" "$stage/nodeproxy"
# The man page, completions and the commented default config come from the code (host build).
env -u RUSTFLAGS -u CFLAGS cargo run --locked --quiet --example dist_assets -- "$stage"
gzip -n -9 -f "$stage/nodeproxy.1"
# The RPM keeps each file's mtime (cargo-generate-rpm does not clamp it to --source-date), and a
# checkout's mtimes are the time of the checkout: package staged copies with a fixed one.
cp systemd/nodeproxy.service systemd/nodeproxy.env README.md LICENSE \
    docs/migrating-from-kube-proxy.md "$stage/"
touch -d "@$SOURCE_DATE_EPOCH" "$stage"/* "$stage"/completions/*

cp "$stage/nodeproxy" "dist/nodeproxy-$version-$target"
cp "$stage/$debug" "dist/$debug"

cargo deb --no-build --no-strip --target "$target" --output "dist/nodeproxy_${version}-1_${deb_arch}.deb"
# No automatic requirements: the binary is static; the one requirement (systemd) is declared.
cargo generate-rpm --target "$target" --arch "$rpm_arch" --auto-req disabled \
    --source-date "$SOURCE_DATE_EPOCH" --output "dist/nodeproxy-${version}-1.${rpm_arch}.rpm"

# From Cargo.toml, not from the checkout's remote: where a clone came from is no input of the
# build, and must not change the image digest.
source_url=${NODEPROXY_SOURCE_URL:-$(sed -n 's/^repository = "\(.*\)"$/\1/p' Cargo.toml | head -n 1)}
digest=$(python3 packaging/oci/build-image.py --binary "$stage/nodeproxy" --version "$version" \
    --revision "$commit" --arch "$oci_arch" --created "$SOURCE_DATE_EPOCH" --source "$source_url" \
    --out "dist/nodeproxy-$version-oci-$oci_arch.tar")
echo "$digest" > "dist/nodeproxy-$version-oci-$oci_arch.digest"

cp packaging/kubernetes/nodeproxy.yaml "dist/nodeproxy-$version.yaml"

(cd dist && sha256sum -- * > SHA256SUMS)
echo "dist: $(ls dist | wc -l) files in dist/ for $target, version $version, commit $commit"
echo "dist: binary $(stat -c %s "$stage/nodeproxy") bytes; image $digest"
