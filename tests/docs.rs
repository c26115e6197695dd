//! The examples in `docs/ruleset.md` are cut from the golden rulesets, so they cannot drift from
//! what nodeproxy renders. Each example sits between two marker lines:
//!
//! ````text
//! <!-- golden: <case> [ip|ip6] <chain|set|map> <name> -->
//! ```nft
//! <the block `<kind> <name> { … }` of table `<family> nodeproxy` in tests/golden/<case>.nft>
//! ```
//! <!-- /golden -->
//! ````
//!
//! The family defaults to `ip`. The block is copied verbatim, indentation included. A marker
//! naming a golden, table or block that does not exist is an error. After an intended change to
//! the goldens (or a new marker), `UPDATE_DOCS=1 cargo test --test docs` rewrites the examples in
//! place; review the diff.

// Tests fail by panicking; that is their job.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::path::PathBuf;

const OPEN: &str = "<!-- golden:";
const CLOSE: &str = "<!-- /golden -->";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// What a marker asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Marker {
    case: String,
    family: String,
    kind: String,
    name: String,
}

impl std::fmt::Display for Marker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {} {} {}",
            self.case, self.family, self.kind, self.name
        )
    }
}

/// Parses the text of an opening marker line (already trimmed).
fn parse_marker(line: &str) -> Result<Marker, String> {
    let inner = line
        .strip_prefix(OPEN)
        .and_then(|rest| rest.strip_suffix("-->"))
        .ok_or_else(|| format!("malformed marker {line:?}"))?;
    let words: Vec<&str> = inner.split_whitespace().collect();
    let (case, family, kind, name) = match words.as_slice() {
        [case, kind, name] => (*case, "ip", *kind, *name),
        [case, family, kind, name] => (*case, *family, *kind, *name),
        _ => {
            return Err(format!(
                "marker {line:?}: expected `golden: <case> [ip|ip6] <chain|set|map> <name>`"
            ));
        }
    };
    if !matches!(family, "ip" | "ip6") {
        return Err(format!("marker {line:?}: family must be ip or ip6"));
    }
    if !matches!(kind, "chain" | "set" | "map") {
        return Err(format!("marker {line:?}: kind must be chain, set or map"));
    }
    Ok(Marker {
        case: case.to_string(),
        family: family.to_string(),
        kind: kind.to_string(),
        name: name.to_string(),
    })
}

/// The block `<kind> <name> { … }` of table `<family> nodeproxy` in a rendered ruleset, verbatim.
fn extract_block(golden: &str, marker: &Marker) -> Result<String, String> {
    let table_head = format!("table {} nodeproxy {{", marker.family);
    let lines: Vec<&str> = golden.lines().collect();
    let start = lines
        .iter()
        .position(|l| *l == table_head)
        .ok_or_else(|| format!("{marker}: no `{table_head}` in the golden"))?;
    // The table ends at its closing brace in column 0.
    let table = lines[start + 1..]
        .iter()
        .take_while(|l| **l != "}")
        .copied()
        .collect::<Vec<_>>();
    let block_head = format!("\t{} {} {{", marker.kind, marker.name);
    let first = table.iter().position(|l| *l == block_head).ok_or_else(|| {
        format!(
            "{marker}: no `{} {}` in table {} nodeproxy",
            marker.kind, marker.name, marker.family
        )
    })?;
    let len = table[first..]
        .iter()
        .position(|l| *l == "\t}")
        .ok_or_else(|| format!("{marker}: block not closed in the golden"))?;
    Ok(table[first..=first + len].join("\n"))
}

/// The body an example must have between its marker lines.
fn example_body(block: &str) -> String {
    format!("```nft\n{block}\n```")
}

/// The outcome of checking a document against the goldens.
#[derive(Debug, Default)]
struct Sync {
    /// The document with every example regenerated.
    updated: String,
    /// Examples whose body differs from their golden block (line of the marker and marker).
    stale: Vec<String>,
    /// Every marker, in order.
    markers: Vec<Marker>,
}

/// Checks every example of `doc` against the goldens `load` returns (by case name; `None` when
/// the golden does not exist). Errors (malformed or unclosed markers, missing goldens, tables or
/// blocks) are all collected and returned together.
fn sync(doc: &str, load: &dyn Fn(&str) -> Option<String>) -> Result<Sync, Vec<String>> {
    let mut out = Sync::default();
    let mut errors = Vec::new();
    let mut goldens: BTreeMap<String, Option<String>> = BTreeMap::new();
    let mut updated: Vec<String> = Vec::new();
    let lines: Vec<&str> = doc.split('\n').collect();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        let trimmed = line.trim();
        updated.push(line.to_string());
        if trimmed == CLOSE {
            errors.push(format!("line {}: `{CLOSE}` without a marker", i + 1));
            i += 1;
            continue;
        }
        if !trimmed.starts_with(OPEN) {
            i += 1;
            continue;
        }
        let at = i + 1;
        let close = lines[i + 1..]
            .iter()
            .position(|l| l.trim() == CLOSE || l.trim().starts_with(OPEN))
            .map(|p| p + i + 1)
            .filter(|&c| lines[c].trim() == CLOSE);
        let Some(close) = close else {
            errors.push(format!("line {at}: marker not closed by `{CLOSE}`"));
            i += 1;
            continue;
        };
        let current = lines[i + 1..close].join("\n");
        let expected = parse_marker(trimmed).and_then(|marker| {
            let golden = goldens
                .entry(marker.case.clone())
                .or_insert_with(|| load(&marker.case));
            let golden = golden
                .as_deref()
                .ok_or_else(|| format!("{marker}: no golden tests/golden/{}.nft", marker.case))?;
            let block = extract_block(golden, &marker)?;
            out.markers.push(marker.clone());
            Ok((marker, example_body(&block)))
        });
        match expected {
            Ok((marker, body)) => {
                if current != body {
                    out.stale.push(format!("line {at}: {marker}"));
                }
                updated.push(body);
            }
            Err(e) => {
                errors.push(format!("line {at}: {e}"));
                updated.push(current);
            }
        }
        updated.push(lines[close].to_string());
        i = close + 1;
    }
    if errors.is_empty() {
        out.updated = updated.join("\n");
        Ok(out)
    } else {
        Err(errors)
    }
}

fn load_golden(case: &str) -> Option<String> {
    std::fs::read_to_string(root().join("tests/golden").join(format!("{case}.nft"))).ok()
}

#[test]
fn every_example_in_the_ruleset_doc_is_the_current_golden_block() {
    let path = root().join("docs/ruleset.md");
    let doc = std::fs::read_to_string(&path).expect("docs/ruleset.md");
    let result = sync(&doc, &load_golden).unwrap_or_else(|errors| {
        panic!(
            "docs/ruleset.md has markers that name no golden block:\n{}",
            errors.join("\n")
        )
    });
    if std::env::var_os("UPDATE_DOCS").is_some() {
        if result.updated != doc {
            // Atomically, so the other tests never read a half-written file.
            let tmp = path.with_extension("md.tmp");
            std::fs::write(&tmp, &result.updated).expect("write docs/ruleset.md.tmp");
            std::fs::rename(&tmp, &path).expect("replace docs/ruleset.md");
        }
        return;
    }
    assert!(
        result.stale.is_empty(),
        "examples in docs/ruleset.md are stale (UPDATE_DOCS=1 cargo test --test docs, then \
         review):\n{}",
        result.stale.join("\n")
    );
}

#[test]
fn the_ruleset_doc_shows_examples_from_both_families() {
    let doc = std::fs::read_to_string(root().join("docs/ruleset.md")).expect("docs/ruleset.md");
    let result = sync(&doc, &load_golden).unwrap_or_else(|errors| panic!("{}", errors.join("\n")));
    assert!(
        result.markers.len() >= 20,
        "expected an example per feature, found {} markers",
        result.markers.len()
    );
    for family in ["ip", "ip6"] {
        assert!(
            result.markers.iter().any(|m| m.family == family),
            "no {family} example"
        );
    }
}

const GOLDEN: &str = "table ip nodeproxy {
\tcomment \"rules for nodeproxy\"
\tset cluster-ips {
\t\ttype ipv4_addr
\t}

\tchain pick-1 {
\t\tdnat ip to 192.0.2.1
\t}
}
table ip6 nodeproxy {
\tchain pick-1 {
\t\tdnat ip6 to 2001:db8::1
\t}
}
";

fn fake(case: &str) -> Option<String> {
    (case == "tiny").then(|| GOLDEN.to_string())
}

#[test]
fn a_stale_example_is_reported_and_regenerated_and_a_current_one_is_kept() {
    let doc = "intro\n<!-- golden: tiny chain pick-1 -->\n```nft\nold\n```\n<!-- /golden -->\n\
               middle\n<!-- golden: tiny ip6 chain pick-1 -->\n```nft\n\tchain pick-1 {\n\
               \t\tdnat ip6 to 2001:db8::1\n\t}\n```\n<!-- /golden -->\nend\n";
    let result = sync(doc, &fake).unwrap();
    assert_eq!(
        result.stale,
        vec!["line 2: tiny ip chain pick-1".to_string()]
    );
    assert_eq!(
        result.updated,
        "intro\n<!-- golden: tiny chain pick-1 -->\n```nft\n\tchain pick-1 {\n\
         \t\tdnat ip to 192.0.2.1\n\t}\n```\n<!-- /golden -->\n\
         middle\n<!-- golden: tiny ip6 chain pick-1 -->\n```nft\n\tchain pick-1 {\n\
         \t\tdnat ip6 to 2001:db8::1\n\t}\n```\n<!-- /golden -->\nend\n"
    );
    let again = sync(&result.updated, &fake).unwrap();
    assert!(again.stale.is_empty());
    assert_eq!(again.updated, result.updated);
}

#[test]
fn an_empty_example_is_filled_in() {
    let doc = "<!-- golden: tiny set cluster-ips -->\n<!-- /golden -->\n";
    let result = sync(doc, &fake).unwrap();
    assert_eq!(result.stale.len(), 1);
    assert_eq!(
        result.updated,
        "<!-- golden: tiny set cluster-ips -->\n```nft\n\tset cluster-ips {\n\
         \t\ttype ipv4_addr\n\t}\n```\n<!-- /golden -->\n"
    );
}

#[test]
fn markers_naming_a_missing_golden_family_or_block_are_all_reported() {
    let doc = "<!-- golden: nosuch chain pick-1 -->\n<!-- /golden -->\n\
               <!-- golden: tiny ip6 set cluster-ips -->\n<!-- /golden -->\n\
               <!-- golden: tiny map pick-1 -->\n<!-- /golden -->\n\
               <!-- golden: tiny inet chain pick-1 -->\n<!-- /golden -->\n\
               <!-- golden: tiny chain nosuch -->\n<!-- /golden -->\n";
    let errors = sync(doc, &fake).unwrap_err();
    assert_eq!(errors.len(), 5, "{errors:#?}");
    assert!(
        errors[0].contains("no golden tests/golden/nosuch.nft"),
        "{errors:#?}"
    );
    assert!(errors[1].contains("set cluster-ips"), "{errors:#?}");
    assert!(errors[2].contains("no `map pick-1`"), "{errors:#?}");
    assert!(
        errors[3].contains("family must be ip or ip6"),
        "{errors:#?}"
    );
    assert!(errors[4].contains("no `chain nosuch`"), "{errors:#?}");
}

#[test]
fn a_missing_table_is_reported() {
    let ip_only = |_: &str| Some("table ip nodeproxy {\n}\n".to_string());
    let errors = sync(
        "<!-- golden: x ip6 chain a -->\n<!-- /golden -->\n",
        &ip_only,
    )
    .unwrap_err();
    assert!(
        errors[0].contains("no `table ip6 nodeproxy {`"),
        "{errors:#?}"
    );
}

#[test]
fn unclosed_and_stray_markers_are_errors() {
    let errors = sync(
        "<!-- golden: tiny chain pick-1 -->\n<!-- golden: tiny set cluster-ips -->\n\
         <!-- /golden -->\n<!-- /golden -->\n",
        &fake,
    )
    .unwrap_err();
    assert_eq!(
        errors,
        vec![
            "line 1: marker not closed by `<!-- /golden -->`".to_string(),
            "line 4: `<!-- /golden -->` without a marker".to_string(),
        ]
    );
}

/// Replaces the text between `<!-- generated: NAME -->` and `<!-- /generated -->` in the file
/// at `rel` with `content`, or (without `UPDATE_DOCS`) fails when it differs.
fn check_generated(rel: &str, name: &str, content: &str) {
    let path = root().join(rel);
    let doc = std::fs::read_to_string(&path).unwrap();
    let open = format!("<!-- generated: {name} -->\n");
    let close = "<!-- /generated -->";
    let start = doc
        .find(&open)
        .unwrap_or_else(|| panic!("{rel} lacks the line `{}`", open.trim_end()))
        + open.len();
    let len = doc[start..]
        .find(close)
        .unwrap_or_else(|| panic!("{rel}: `{}` is not closed", open.trim_end()));
    if &doc[start..start + len] == content {
        return;
    }
    if std::env::var_os("UPDATE_DOCS").is_some() {
        let updated = format!("{}{content}{}", &doc[..start], &doc[start + len..]);
        let tmp = path.with_extension("md.tmp");
        std::fs::write(&tmp, updated).unwrap();
        std::fs::rename(&tmp, &path).unwrap();
        return;
    }
    panic!(
        "the `{name}` block of {rel} is stale (UPDATE_DOCS=1 cargo test --test docs, then \
         review); it should be:\n{content}"
    );
}

#[test]
fn the_readme_settings_table_is_generated_from_the_declarations() {
    check_generated("README.md", "settings", &nodeproxy::config::readme_table());
}

#[test]
fn the_migration_guide_lists_every_kube_proxy_flag_and_field_as_the_code_treats_it() {
    check_generated(
        "docs/migrating-from-kube-proxy.md",
        "kube-proxy",
        &nodeproxy::config::migration_tables(),
    );
}
