#!/usr/bin/env python3
"""Writes nodeproxy's OCI image as an OCI image-layout archive, without a container daemon.

One layer holding only the static binary at /nodeproxy (the in-cluster client reads the service
account's CA from its mounted secret, so no CA bundle is needed; in-cluster configuration is an
IP address, so no resolver either). Byte-reproducible: tar entries sorted, mtime from
SOURCE_DATE_EPOCH, owner 0:0 without names, gzip without name or timestamp, JSON with sorted
keys. The layout follows opencontainers/image-spec (image-layout.md, manifest.md, config.md):
blobs are named by the sha256 of their bytes; the config's rootfs.diff_ids are digests of the
*uncompressed* layer, the manifest's layer digest is that of the compressed blob.

usage: build-image.py --binary PATH --version V --revision R --arch amd64 --created EPOCH
                      [--source URL] --out IMAGE.tar
"""

import argparse
import datetime
import gzip
import hashlib
import io
import json
import sys
import tarfile


def canonical(obj):
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def tar_bytes(entries, mtime):
    """entries: [(name, bytes or None for a directory, mode)], written in name order."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data, mode in sorted(entries, key=lambda e: e[0]):
            info = tarfile.TarInfo(name)
            info.mtime = mtime
            info.mode = mode
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def sha256(data):
    return "sha256:" + hashlib.sha256(data).hexdigest()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--binary", required=True)
    parser.add_argument("--version", required=True)
    parser.add_argument("--revision", required=True)
    parser.add_argument("--arch", required=True)
    parser.add_argument("--created", required=True, type=int)
    parser.add_argument("--source", default="")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    with open(args.binary, "rb") as f:
        binary = f.read()
    created = datetime.datetime.fromtimestamp(args.created, datetime.timezone.utc)
    created_text = created.strftime("%Y-%m-%dT%H:%M:%SZ")

    layer = tar_bytes([("nodeproxy", binary, 0o755)], args.created)
    compressed = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=compressed, mtime=0, compresslevel=9) as gz:
        gz.write(layer)
    layer_gz = compressed.getvalue()

    labels = {
        "org.opencontainers.image.title": "nodeproxy",
        "org.opencontainers.image.description": "kube-proxy replacement that programs nftables over netlink",
        "org.opencontainers.image.version": args.version,
        "org.opencontainers.image.revision": args.revision,
        "org.opencontainers.image.licenses": "Apache-2.0",
        "org.opencontainers.image.created": created_text,
    }
    if args.source:
        labels["org.opencontainers.image.source"] = args.source

    config = canonical({
        "architecture": args.arch,
        "os": "linux",
        "created": created_text,
        "config": {"Entrypoint": ["/nodeproxy"], "Labels": labels},
        "rootfs": {"type": "layers", "diff_ids": [sha256(layer)]},
        "history": [{"created": created_text, "created_by": "scripts/dist.sh (packaging/oci/build-image.py)"}],
    })
    manifest = canonical({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": sha256(config),
            "size": len(config),
        },
        "layers": [{
            "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
            "digest": sha256(layer_gz),
            "size": len(layer_gz),
        }],
        "annotations": labels,
    })
    index = canonical({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": sha256(manifest),
            "size": len(manifest),
            "platform": {"architecture": args.arch, "os": "linux"},
            "annotations": {"org.opencontainers.image.ref.name": args.version},
        }],
    })

    entries = [
        ("oci-layout", canonical({"imageLayoutVersion": "1.0.0"}), 0o644),
        ("index.json", index, 0o644),
        ("blobs", None, 0o755),
        ("blobs/sha256", None, 0o755),
    ]
    for blob in (config, manifest, layer_gz):
        entries.append(("blobs/sha256/" + hashlib.sha256(blob).hexdigest(), blob, 0o644))
    with open(args.out, "wb") as f:
        f.write(tar_bytes(entries, args.created))
    print(sha256(manifest))


if __name__ == "__main__":
    sys.exit(main())
