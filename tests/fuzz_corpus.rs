//! The fuzz targets' corpora as ordinary tests on the stable toolchain (`fuzz/`; the bounded
//! and long fuzzing runs are `scripts/fuzz.sh`):
//!
//! - every seed of `file_reader`, and every prefix of it, is read as YAML and as JSON without a
//!   panic; what loads builds and renders, and `nft -c` (in a network namespace of the test's)
//!   accepts the rendering;
//! - `netlink_decode` gets the batches nodeproxy encodes for every golden (the same attribute
//!   layouts as the kernel's dump replies), every prefix of them and deterministic byte flips:
//!   decoding never panics, and the intact batches decode to something;
//! - `sync_diff` (the property in `fuzz/fuzz_targets/common/sync_diff.rs`) holds for every seed
//!   and for 400 more deterministic pseudo-random inputs.
//!
//! `UPDATE_FUZZ_SEEDS=1 cargo test --test fuzz_corpus` rewrites the `netlink_decode` seeds.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

#[path = "../fuzz/fuzz_targets/common/sync_diff.rs"]
mod sync_diff;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::netns::in_netns;
use nodeproxy::config::Config;
use nodeproxy::nft::netlink::{decode_any, encode_batch};
use nodeproxy::nft::wire::lower;
use nodeproxy::ruleset::{self, Settings};
use nodeproxy::source::file::load_text;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn seeds(target: &str) -> Vec<PathBuf> {
    let dir = root().join("fuzz/corpus").join(target);
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    paths.sort();
    assert!(!paths.is_empty(), "no seeds in {}", dir.display());
    paths
}

fn settings() -> Settings {
    Settings::new(&Config::default(), "node-a".to_string())
}

#[test]
fn every_file_reader_seed_and_its_prefixes_read_without_panicking_and_render_what_nft_accepts() {
    let mut renders = Vec::new();
    for path in seeds("file_reader") {
        let text = std::fs::read_to_string(&path).unwrap();
        let mut loaded_any = false;
        for name in ["seed.yaml", "seed.json"] {
            if let Ok(loaded) = load_text(Path::new(name), &text) {
                loaded_any = true;
                let built = ruleset::build(&loaded.state, &settings());
                renders.push((path.clone(), ruleset::render::render(&built)));
            }
            // About 200 prefixes: a file cut short anywhere (the fuzzer explores the rest).
            let step = (text.len() / 200).max(1);
            for end in (0..text.len())
                .step_by(step)
                .filter(|&e| text.is_char_boundary(e))
            {
                let _ = load_text(Path::new(name), &text[..end]);
            }
        }
        assert!(
            loaded_any,
            "{} is not a seed the reader takes",
            path.display()
        );
    }
    let checked = in_netns(move || {
        let mut checked = 0;
        for (path, render) in &renders {
            let file = std::env::temp_dir().join(format!("np-fuzz-{}.nft", std::process::id()));
            std::fs::write(&file, render).unwrap();
            let out = Command::new("nft")
                .arg("-c")
                .arg("-f")
                .arg(&file)
                .output()
                .unwrap();
            let _ = std::fs::remove_file(&file);
            assert!(
                out.status.success(),
                "nft -c refuses the rendering of {}: {}",
                path.display(),
                String::from_utf8_lossy(&out.stderr)
            );
            checked += 1;
        }
        checked
    });
    assert!(checked >= 10, "only {checked} renderings checked");
}

/// The batches nodeproxy sends to create each golden's tables from nothing.
fn encoded_goldens() -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    for path in seeds("file_reader") {
        let text = std::fs::read_to_string(&path).unwrap();
        let name = if path.extension().is_some_and(|e| e == "json") {
            "seed.json"
        } else {
            "seed.yaml"
        };
        let Ok(loaded) = load_text(Path::new(name), &text) else {
            continue;
        };
        let built = ruleset::build(&loaded.state, &settings());
        for table in &built.tables {
            let want = lower(table).unwrap();
            let plan = nodeproxy::nft::diff(None, &want);
            let batch = encode_batch(table.family, &table.name, &plan.phase1, 1).unwrap();
            let stem = path.file_stem().unwrap().to_string_lossy().into_owned();
            out.push((format!("{stem}-{:?}", table.family), batch.buf));
        }
    }
    out
}

#[test]
fn netlink_decoding_never_panics_on_encoded_tables_cut_or_flipped() {
    let batches = encoded_goldens();
    assert!(batches.len() >= 10, "{} batches", batches.len());
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for (name, bytes) in &batches {
        assert!(decode_any(bytes) > 0, "{name} decodes to nothing");
        // About 300 cut points and 300 flips per batch keep this test to seconds in a debug
        // build; the fuzzer explores the rest.
        for end in (0..bytes.len()).step_by((bytes.len() / 300).max(1)) {
            let _ = decode_any(&bytes[..end]);
        }
        for _ in 0..300 {
            let mut flipped = bytes.clone();
            let at = usize::try_from(next() % u64::try_from(flipped.len()).unwrap()).unwrap();
            flipped[at] ^= u8::try_from(next() & 0xff).unwrap() | 1;
            let _ = decode_any(&flipped);
        }
    }
    for path in seeds("netlink_decode") {
        let _ = decode_any(&std::fs::read(&path).unwrap());
    }
    if std::env::var_os("UPDATE_FUZZ_SEEDS").is_some() {
        let dir = root().join("fuzz/corpus/netlink_decode");
        for (name, bytes) in batches.iter().filter(|(n, _)| {
            ["clusterip", "affinity", "source-ranges", "dualstack"]
                .iter()
                .any(|k| n.starts_with(k))
        }) {
            std::fs::write(dir.join(name), bytes).unwrap();
        }
    }
}

#[test]
fn diffs_and_incremental_syncs_hold_for_every_sync_diff_seed_and_random_sequences() {
    for path in seeds("sync_diff") {
        let data = std::fs::read(&path).unwrap();
        sync_diff::check(&data);
    }
    let mut x: u64 = 0x2545_F491_4F6C_DD1D;
    for len in (0..400).map(|i| 8 + i % 120) {
        let data: Vec<u8> = (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x.to_be_bytes()[4]
            })
            .collect();
        sync_diff::check(&data);
    }
}
