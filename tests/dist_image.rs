//! The OCI image scripts/dist.sh wrote into dist/: unpacked with umoci, its binary run from the
//! unpacked root filesystem (no libc, no shell, nothing but /nodeproxy) in the namespace lab's
//! nodes, programming rules that carry real traffic.
//!
//! Built only with the `dist-tests` feature (scripts/test.sh runs scripts/dist.sh first, then
//! the tests with every feature); `NODEPROXY_DIST_DIR` names another dist folder. A missing image
//! fails the test: it never passes without having run the image.

#![allow(clippy::panic, clippy::expect_used, clippy::unwrap_used)]

mod lab;

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::Command;

use lab::{Lab, Ns, Proto, describe};

const CLUSTER_CIDR: &str = "198.51.100.0/24,2001:db8:a::/47";

fn dist_dir() -> PathBuf {
    std::env::var_os("NODEPROXY_DIST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("dist"))
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(out.status.success(), "{cmd:?}: {}", describe(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Unpacks the image archive into a fresh directory; returns (the directory, its rootfs).
fn unpack_image() -> (tempdir::Dir, PathBuf) {
    let version = env!("CARGO_PKG_VERSION");
    let archive = dist_dir().join(format!("nodeproxy-{version}-oci-amd64.tar"));
    assert!(
        archive.is_file(),
        "{} is missing: run scripts/dist.sh first (scripts/test.sh does)",
        archive.display()
    );
    let dir = tempdir::Dir::new("nodeproxy-image");
    let layout = dir.path().join("layout");
    std::fs::create_dir(&layout).unwrap();
    run(Command::new("tar")
        .arg("-xf")
        .arg(&archive)
        .arg("-C")
        .arg(&layout));
    let bundle = dir.path().join("bundle");
    run(Command::new("umoci")
        .arg("unpack")
        .arg("--image")
        .arg(format!("{}:{version}", layout.display()))
        .arg(&bundle));
    let rootfs = bundle.join("rootfs");
    (dir, rootfs)
}

#[test]
fn the_image_binary_programs_a_node_from_its_bare_root_and_traffic_flows() {
    lab::require_privileges();
    let (_dir, rootfs) = unpack_image();
    let entries: Vec<String> = std::fs::read_dir(&rootfs)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        entries,
        ["nodeproxy"],
        "the image holds more than the binary"
    );

    // The fixtures go into the unpacked root, the only filesystem the binary sees.
    let fixtures = rootfs.join("fixtures");
    std::fs::create_dir(&fixtures).unwrap();
    for name in ["nodes.yaml", "web.yaml"] {
        std::fs::copy(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/fixtures/traffic")
                .join(name),
            fixtures.join(name),
        )
        .unwrap();
    }

    let mut lab = Lab::new();
    lab.spawn_server(Ns::PodA2, Proto::Tcp, 8080, "a2");
    lab.spawn_server(Ns::PodB1, Proto::Tcp, 8080, "b1");
    let root = rootfs.to_str().unwrap();
    for node in [Ns::NodeA, Ns::NodeB] {
        let out = lab.exec(
            node,
            &[
                "timeout",
                "30",
                "chroot",
                root,
                "/nodeproxy",
                "--once",
                "--hostname-override",
                node.role(),
                "--cluster-cidr",
                CLUSTER_CIDR,
                "--lock-file",
                "/nodeproxy.lock",
                "--from-file",
                "/fixtures/nodes.yaml",
                "--from-file",
                "/fixtures/web.yaml",
            ],
        );
        assert!(
            out.status.success(),
            "the image's nodeproxy --once on {}: {}",
            node.role(),
            describe(&out)
        );
    }

    let service: IpAddr = "203.0.113.10".parse().unwrap();
    let mut answered = BTreeSet::new();
    for i in 0..20 {
        match lab.request(Ns::PodA1, Proto::Tcp, service, 80) {
            Ok((name, peer)) => {
                assert_eq!(peer, Ns::PodA1.addr(false).to_string(), "request {i}");
                answered.insert(name);
            }
            Err(e) => panic!(
                "request {i} to {service}:80 failed: {e}\n{}",
                lab.ruleset(Ns::NodeA)
            ),
        }
    }
    let expected: BTreeSet<String> = ["a2", "b1"].iter().map(|s| s.to_string()).collect();
    assert_eq!(answered, expected, "{}", lab.ruleset(Ns::NodeA));
}

/// A temporary directory removed on drop (also when the test panics).
mod tempdir {
    use std::path::{Path, PathBuf};

    pub struct Dir(PathBuf);

    impl Dir {
        pub fn new(prefix: &str) -> Dir {
            let path = std::env::temp_dir().join(format!("{prefix}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&path);
            std::fs::create_dir_all(&path).unwrap();
            Dir(path)
        }

        pub fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}
