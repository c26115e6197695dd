//! The tests' fake API server (`tests/fakeapi`) as a program, for the tests that run nodeproxy
//! where a Rust test cannot reach: the packaged unit under a real systemd inside a container
//! (`scripts/test-dist.sh`). Serves the objects of YAML files on 127.0.0.1 and writes a
//! kubeconfig pointing at them; a control directory changes what it serves while it runs.
//!
//! usage: fakeapi_server --kubeconfig OUT --ca CA_PATH [--control DIR] FILE...
//!
//! Control: a `*.yaml` file put into DIR is applied (objects added or replaced) and removed;
//! an empty file `hold-services` (or `-endpointslices`, `-nodes`) makes lists and watches of
//! that kind wait, `release-services` lets them go.

#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#[path = "../tests/fakeapi/mod.rs"]
mod fakeapi;

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context as _, bail};
use fakeapi::{FakeApi, Kind};
use serde::Deserialize as _;
use serde_json::Value;

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let mut kubeconfig = None;
    let mut ca = None;
    let mut control = None;
    let mut files = Vec::new();
    let mut args = std::env::args_os().skip(1);
    while let Some(arg) = args.next() {
        match arg.to_str() {
            Some("--kubeconfig") => kubeconfig = args.next().map(PathBuf::from),
            Some("--ca") => ca = args.next().map(PathBuf::from),
            Some("--control") => control = args.next().map(PathBuf::from),
            _ => files.push(PathBuf::from(arg)),
        }
    }
    let (Some(kubeconfig), Some(ca)) = (kubeconfig, ca) else {
        bail!("usage: fakeapi_server --kubeconfig OUT --ca CA_PATH [--control DIR] FILE...");
    };

    let api = FakeApi::start().await;
    for file in &files {
        apply_file(&api, file)?;
    }
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {}\n    certificate-authority: {}\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\ncurrent-context: fake\nusers:\n- name: fake\n  user: {{}}\n",
            api.url(),
            ca.display()
        ),
    )
    .with_context(|| format!("writing {}", kubeconfig.display()))?;
    println!("fakeapi_server: serving {} at {}", files.len(), api.url());

    loop {
        if let Some(dir) = &control {
            poll_control(&api, dir)?;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn poll_control(api: &FakeApi, dir: &Path) -> anyhow::Result<()> {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|entry| entry.ok().map(|entry| entry.path()))
        .collect();
    entries.sort();
    for path in entries {
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        let kind = |word: &str| match word {
            "services" => Some(Kind::Service),
            "endpointslices" => Some(Kind::EndpointSlice),
            "nodes" => Some(Kind::Node),
            "servicecidrs" => Some(Kind::ServiceCidr),
            _ => None,
        };
        if let Some(kind) = name.strip_prefix("hold-").and_then(kind) {
            api.hold(kind);
        } else if let Some(kind) = name.strip_prefix("release-").and_then(kind) {
            api.release(kind);
        } else if name.ends_with(".yaml") {
            apply_file(api, &path)?;
        } else {
            continue;
        }
        std::fs::remove_file(&path).with_context(|| format!("removing {}", path.display()))?;
        println!("fakeapi_server: {name} done");
    }
    Ok(())
}

/// Applies every Service, EndpointSlice, Node and ServiceCIDR of a YAML file (several documents, or `List`s).
fn apply_file(api: &FakeApi, path: &Path) -> anyhow::Result<()> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    for document in serde_yaml_ng::Deserializer::from_str(&text) {
        let value =
            Value::deserialize(document).with_context(|| format!("parsing {}", path.display()))?;
        let items = match value.get("kind").and_then(Value::as_str) {
            Some("List") => value
                .get("items")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default(),
            _ => vec![value],
        };
        for item in items {
            let kind = match item.get("kind").and_then(Value::as_str) {
                Some("Service") => Kind::Service,
                Some("EndpointSlice") => Kind::EndpointSlice,
                Some("Node") => Kind::Node,
                Some("ServiceCIDR") => Kind::ServiceCidr,
                Some(_) | None => continue,
            };
            api.apply(kind, item);
        }
    }
    Ok(())
}
