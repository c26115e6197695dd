//! Golden rulesets: each fixture in `tests/fixtures/golden/<case>.yaml`, rendered with the CLI
//! arguments in `<case>.args`, must equal `tests/golden/<case>.nft`, and every golden file must
//! be accepted by `nft -c -f` (nft is the oracle for our syntax).
//!
//! Regenerate after an intended change with `UPDATE_GOLDEN=1 cargo test --test golden`, then
//! review the diff: the goldens are the ruleset's documentation.
//!
//! A case with a previous state in `tests/fixtures/golden/before/<case>.yaml` renders as any
//! other (the ruleset depends on the state alone); `tests/kernel_goldens.rs` programs it over
//! the previous state's table and checks that the kernel converges to the same golden.

// Tests fail by panicking; that is their job.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::Command;

use nodeproxy::config;
use nodeproxy::nft;
use nodeproxy::ruleset::{self, Settings};
use nodeproxy::source;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The fixture cases, by name, plus the bundled example cluster.
fn cases() -> Vec<(String, PathBuf, Vec<String>)> {
    let dir = root().join("tests/fixtures/golden");
    let mut out = Vec::new();
    for entry in std::fs::read_dir(&dir).expect("fixture directory") {
        let path = entry.expect("dir entry").path();
        if path.extension().and_then(|e| e.to_str()) != Some("yaml") {
            continue;
        }
        let name = path.file_stem().unwrap().to_string_lossy().into_owned();
        let args = std::fs::read_to_string(path.with_extension("args"))
            .unwrap_or_else(|_| panic!("{name}: missing {name}.args next to the fixture"));
        out.push((
            name,
            path,
            args.split_whitespace().map(String::from).collect(),
        ));
    }
    out.push((
        "example-cluster".to_string(),
        root().join("examples/cluster.yaml"),
        "--hostname-override node-a --cluster-cidr 10.244.0.0/16,fd00:10:244::/48"
            .split_whitespace()
            .map(String::from)
            .collect(),
    ));
    out.sort();
    assert!(
        out.len() >= 6,
        "expected the golden fixtures, found {}",
        out.len()
    );
    out
}

/// Builds a fixture exactly as `nodeproxy --dry-run` does.
fn build_case(path: &Path, args: &[String]) -> ruleset::Ruleset {
    let mut argv = vec!["nodeproxy".to_string(), "--dry-run".to_string()];
    argv.extend(args.iter().cloned());
    argv.push("--from-file".into());
    argv.push(path.to_string_lossy().into_owned());
    let no_env = |_: &str| None;
    let loaded = config::load(argv.iter().map(Into::into), &no_env).expect("fixture args");
    let input = source::file::load_files(&loaded.config.from_file).expect("fixture parses");
    let settings = Settings::new(
        &loaded.config,
        loaded.config.node_name().expect("node name"),
    );
    ruleset::build(&input.state, &settings)
}

/// Renders a fixture as `nodeproxy --dry-run` does (minus its header comment line).
pub fn render_case(path: &Path, args: &[String]) -> String {
    ruleset::render::render(&build_case(path, args))
}

#[test]
fn rendered_rulesets_match_the_checked_in_goldens() {
    let update = std::env::var_os("UPDATE_GOLDEN").is_some();
    let mut stale = Vec::new();
    for (name, path, args) in cases() {
        let rendered = render_case(&path, &args);
        let golden = root().join("tests/golden").join(format!("{name}.nft"));
        if update {
            std::fs::write(&golden, &rendered).expect("write golden");
            continue;
        }
        let expected = std::fs::read_to_string(&golden)
            .unwrap_or_else(|_| panic!("{name}: no golden file {}", golden.display()));
        if expected != rendered {
            let first = expected
                .lines()
                .zip(rendered.lines())
                .position(|(a, b)| a != b)
                .unwrap_or(expected.lines().count().min(rendered.lines().count()));
            stale.push(format!(
                "{name}: first difference at line {}:\n  golden:   {:?}\n  rendered: {:?}",
                first + 1,
                expected.lines().nth(first),
                rendered.lines().nth(first)
            ));
        }
    }
    assert!(
        stale.is_empty(),
        "goldens are stale (UPDATE_GOLDEN=1 cargo test --test golden, then review):\n{}",
        stale.join("\n")
    );
}

#[test]
fn every_golden_is_accepted_by_nft_check() {
    let dir = root().join("tests/golden");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).expect("golden directory") {
        let path = entry.expect("dir entry").path();
        if path.extension().and_then(|e| e.to_str()) != Some("nft") {
            continue;
        }
        let out = Command::new("nft")
            .arg("-c")
            .arg("-f")
            .arg(&path)
            .output()
            .expect("nft must be installed (apt-get install nftables): it is the test oracle");
        assert!(
            out.status.success(),
            "nft -c rejected {}:\n{}",
            path.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        checked += 1;
    }
    assert_eq!(checked, cases().len(), "one golden per case");
}

#[test]
fn dry_run_output_is_the_rendering_behind_a_comment_header() {
    let example = root().join("examples/cluster.yaml");
    let out = Command::new(env!("CARGO_BIN_EXE_nodeproxy"))
        .args([
            "--dry-run",
            "--hostname-override",
            "node-a",
            "--cluster-cidr",
        ])
        .arg("10.244.0.0/16,fd00:10:244::/48")
        .arg("--from-file")
        .arg(&example)
        .output()
        .expect("run nodeproxy");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).expect("utf-8");
    let (header, body) = stdout.split_once('\n').expect("header line");
    assert!(header.starts_with("# nodeproxy ruleset for node \"node-a\""));
    let golden = std::fs::read_to_string(root().join("tests/golden/example-cluster.nft"))
        .expect("example golden");
    assert_eq!(body, golden);
}

#[test]
fn unparsable_input_exits_2_naming_the_file_and_position() {
    let dir = std::env::temp_dir().join(format!("nodeproxy-golden-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.yaml");
    std::fs::write(
        &bad,
        "apiVersion: v1\nkind: List\nitems:\n- {kind: Service\n",
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_nodeproxy"))
        .args(["--dry-run", "--hostname-override", "node-a", "--from-file"])
        .arg(&bad)
        .output()
        .expect("run nodeproxy");
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("bad.yaml"), "{stderr}");
    assert!(stderr.contains("line"), "{stderr}");
}

/// The probe covers what the registry lists (`nft::probe`'s tests); this closes the loop: what
/// the builder emits for every fixture lowers only to registered expression kinds.
#[test]
fn every_expression_the_goldens_lower_to_is_a_registered_kind() {
    let known: std::collections::BTreeSet<&str> = nft::kind_names().collect();
    let mut used = std::collections::BTreeSet::new();
    for (name, path, args) in cases() {
        for table in build_case(&path, &args).tables {
            let lowered = nft::lower(&table).unwrap_or_else(|e| panic!("{name}: {e}"));
            for chain in lowered.chains.values() {
                for rule in &chain.rules {
                    used.extend(rule.exprs.iter().map(|e| e.name.clone()));
                }
            }
        }
    }
    let unknown: Vec<&String> = used
        .iter()
        .filter(|k| !known.contains(k.as_str()))
        .collect();
    assert!(
        unknown.is_empty(),
        "unregistered expression kinds: {unknown:?}"
    );
    // Every registered kind is used by some fixture: a kind nothing emits is dead code.
    let unused: Vec<&&str> = known.iter().filter(|k| !used.contains(**k)).collect();
    assert!(
        unused.is_empty(),
        "registered kinds no fixture uses: {unused:?}"
    );
}
