//! The module graph follows the data flow: a scan of `src/` for `crate::<module>` paths (tests
//! excluded) checks that every module uses only modules of lower layers in [`LAYERS`], so there
//! are no cycles and no upward imports. docs/architecture.md explains the layers; a new module
//! is added to them here, in the layer its dependencies put it.

// Tests fail by panicking; that is their job.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The library's top-level modules from the bottom up: a module may use the modules of the layers
/// before its own and no others (not even one of its own layer). `main.rs` dispatches and may use
/// anything.
const LAYERS: &[&[&str]] = &[
    // How an error and its causes are shown, which every layer needs; the token bucket's
    // arithmetic, which rate limits in two layers share; the hasher of caches keyed by
    // addresses, which three layers use.
    &["address_hash", "report", "token_bucket"],
    // Leaves: the validated cluster state, and services that know nothing of it (the netlink
    // transport shared by nf_tables and ctnetlink among them, and the node's conntrack sysctls).
    &["model", "netlink", "http", "lock", "notify", "node_setup"],
    // What reads the cluster, the pure desired state, and the metrics registry and server.
    &["source", "ruleset", "metrics"],
    // The kernel's side (nf_tables, ctnetlink), the packet walk's report, health.
    &["nft", "conntrack", "explain", "health"],
    // The writer.
    &["sync"],
    // The command line, then the configuration built from it (and files, environment).
    &["cli"],
    &["config"],
    // The process: the daemon, and the one-shot modes (which read the API through it).
    &["daemon"],
    &["oneshot"],
];

fn src() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level module a file belongs to (`nft` for `src/nft/wire.rs`), or `None` for the crate
/// roots and for test-only files (`tests.rs`, `x/tests/…`, `test_client.rs`).
fn module_of(path: &Path) -> Option<String> {
    let rel = path.strip_prefix(src()).unwrap();
    let parts: Vec<&str> = rel.iter().map(|p| p.to_str().unwrap()).collect();
    if parts
        .iter()
        .any(|p| *p == "tests" || *p == "tests.rs" || *p == "test_client.rs")
    {
        return None;
    }
    let first = parts[0].trim_end_matches(".rs");
    (first != "lib" && first != "main").then(|| first.to_string())
}

/// The code of a file without its inline `#[cfg(test)] mod tests { … }` (always its last item)
/// and without comments.
fn non_test_code(text: &str) -> String {
    let code = match text.find("#[cfg(test)]\nmod tests {") {
        Some(i) => &text[..i],
        None => text,
    };
    code.lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The modules named by `crate::<module>` paths in `code`, including grouped imports
/// (`use crate::{a, b::c}`).
fn uses(code: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    for (i, _) in code.match_indices("crate::") {
        let rest = &code[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // Only the first segment of each item of the group names a module.
            let mut depth = 0usize;
            let mut item_start = true;
            for (j, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => item_start = true,
                    c if item_start && !c.is_whitespace() => {
                        found.insert(ident(&group[j..]));
                        item_start = false;
                    }
                    _ => {}
                }
            }
        } else {
            found.insert(ident(rest));
        }
    }
    found.retain(|m| !m.is_empty());
    found
}

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|layer| layer.contains(&module))
}

#[test]
fn modules_use_only_lower_layers() {
    let mut files = Vec::new();
    rust_files(&src(), &mut files);
    let mut graph: BTreeMap<String, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
    for path in &files {
        let Some(module) = module_of(path) else {
            continue;
        };
        let code = non_test_code(&std::fs::read_to_string(path).unwrap());
        let rel = path.strip_prefix(src()).unwrap().display().to_string();
        for used in uses(&code) {
            if used != module {
                graph
                    .entry(module.clone())
                    .or_default()
                    .entry(used)
                    .or_default()
                    .insert(rel.clone());
            }
        }
        graph.entry(module).or_default();
    }
    let mut problems = Vec::new();
    for (module, deps) in &graph {
        let Some(own) = layer_of(module) else {
            problems.push(format!(
                "module `{module}` is in no layer of tests/architecture.rs"
            ));
            continue;
        };
        for (used, files) in deps {
            match layer_of(used) {
                Some(l) if l < own => {}
                Some(_) => problems.push(format!(
                    "`{module}` uses `{used}`, which is not below it (in {})",
                    files.iter().cloned().collect::<Vec<_>>().join(", ")
                )),
                None => problems.push(format!(
                    "`{module}` uses `{used}`, which is in no layer (in {})",
                    files.iter().cloned().collect::<Vec<_>>().join(", ")
                )),
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    // The scan found the modules the layers name, so a broken scan cannot pass silently.
    for layer in LAYERS {
        for module in *layer {
            assert!(graph.contains_key(*module), "no file of module `{module}`");
        }
    }
    assert!(
        graph["daemon"].contains_key("sync") && graph["sync"].contains_key("nft"),
        "the scan missed known imports: {graph:?}"
    );
}

#[test]
fn the_scan_reads_grouped_and_nested_imports() {
    let code = "use crate::{model::{A, B}, nft};\nlet x = crate::sync::f();\n";
    assert_eq!(
        uses(code),
        BTreeSet::from(["model".into(), "nft".into(), "sync".into()])
    );
    let cut =
        non_test_code("use crate::a;\n// crate::b\n#[cfg(test)]\nmod tests {\nuse crate::c;\n}");
    assert_eq!(uses(&cut), BTreeSet::from(["a".into()]));
}
