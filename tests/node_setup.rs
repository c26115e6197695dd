//! Kernel test of the node set-up: `node_setup::apply` against the real /proc/sys inside a
//! fresh network namespace, checking what the kernel lets a namespace change (the TCP and UDP
//! timeouts, be_liberal) and what it refuses (`nf_conntrack_max` outside the initial
//! namespace: a warning, not a failure), and that the host's values never move. Needs root;
//! fails (never skips) without it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::netns::in_netns;
use nodeproxy::node_setup::{Conntrack, NodeSetupError, apply};

const NETFILTER: &str = "/proc/sys/net/netfilter";

/// The sysctls the test writes, all per network namespace.
const PER_NETNS: &[&str] = &[
    "nf_conntrack_tcp_timeout_established",
    "nf_conntrack_tcp_timeout_close_wait",
    "nf_conntrack_tcp_be_liberal",
    "nf_conntrack_udp_timeout",
    "nf_conntrack_udp_timeout_stream",
];

fn read(file: &str) -> i64 {
    let path = Path::new(NETFILTER).join(file);
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
        .trim()
        .parse()
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The values of the calling thread's namespace.
fn snapshot() -> Vec<(&'static str, i64)> {
    PER_NETNS
        .iter()
        .chain(&["nf_conntrack_max"])
        .map(|f| (*f, read(f)))
        .collect()
}

/// nf_conntrack's sysctls appear once the module is loaded (built in on some kernels).
fn ensure_conntrack_loaded() {
    if Path::new(NETFILTER).join("nf_conntrack_max").exists() {
        return;
    }
    let status = Command::new("modprobe")
        .arg("nf_conntrack")
        .status()
        .unwrap_or_else(|e| panic!("{NETFILTER} has no nf_conntrack_max and modprobe fails: {e}"));
    assert!(status.success(), "modprobe nf_conntrack: {status}");
    assert!(
        Path::new(NETFILTER).join("nf_conntrack_max").exists(),
        "nf_conntrack loaded but {NETFILTER}/nf_conntrack_max is missing"
    );
}

/// A stand-in for /sys: the hash size is a module parameter, global to the machine and
/// writable only from the initial namespace, so the test never points the writer at the real
/// one.
struct FakeSys(PathBuf);

impl FakeSys {
    fn new(hashsize: i64) -> FakeSys {
        let dir =
            std::env::temp_dir().join(format!("nodeproxy-node-setup-it-{}", std::process::id()));
        let params = dir.join("module/nf_conntrack/parameters");
        std::fs::create_dir_all(&params).unwrap();
        std::fs::write(params.join("hashsize"), hashsize.to_string()).unwrap();
        FakeSys(dir)
    }
}

impl Drop for FakeSys {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn per_namespace_conntrack_sysctls_are_set_and_the_max_is_a_warning() {
    ensure_conntrack_loaded();
    let host_before = snapshot();
    let host_max = read("nf_conntrack_max");
    // Large enough that the hash size is never written, so the fake only has to exist.
    let sys = FakeSys::new(i64::from(u32::MAX));
    let sys_path = sys.0.clone();

    let (first, second, start, read_back, max_in_netns) = in_netns(move || {
        let start = snapshot();
        // Values that differ from whatever the new namespace starts with, so each is a
        // change; +1 keeps them valid and distinct.
        let pick = |file: &str, want: u64| {
            let current = start.iter().find(|(f, _)| *f == file).unwrap().1;
            if i64::try_from(want).unwrap() == current {
                want + 1
            } else {
                want
            }
        };
        let settings = Conntrack {
            // Above what the namespace shows (the host's max), so the writer must try to raise
            // it: the kernel has the file 0444 outside the initial namespace.
            max_per_core: 1,
            min: u32::try_from(host_max + 4096).unwrap(),
            tcp_established_timeout: Duration::from_secs(pick(
                "nf_conntrack_tcp_timeout_established",
                7207,
            )),
            tcp_close_wait_timeout: Duration::from_secs(pick(
                "nf_conntrack_tcp_timeout_close_wait",
                67,
            )),
            tcp_be_liberal: true,
            udp_timeout: Duration::from_secs(pick("nf_conntrack_udp_timeout", 37)),
            udp_stream_timeout: Duration::from_secs(pick("nf_conntrack_udp_timeout_stream", 127)),
        };
        let max_in_netns = read("nf_conntrack_max");
        let first = apply(Path::new("/proc/sys"), &sys_path, 2, &settings);
        let read_back = snapshot();
        let second = apply(Path::new("/proc/sys"), &sys_path, 2, &settings);
        let first = (
            first
                .changes
                .iter()
                .map(|c| (c.name, c.old, c.new))
                .collect::<Vec<_>>(),
            first
                .warnings
                .iter()
                .map(|w| (w.name, describe(&w.error), w.to_string()))
                .collect::<Vec<_>>(),
            settings,
        );
        let second = (
            second.changes.len(),
            second.warnings.iter().map(|w| w.name).collect::<Vec<_>>(),
        );
        (first, second, start, read_back, max_in_netns)
    });
    let (changes, warnings, settings) = first;

    // The namespace shows the host's nf_conntrack_max (one global limit).
    assert_eq!(max_in_netns, host_max);

    // Every per-namespace value was written and reads back.
    let secs = |d: Duration| i64::try_from(d.as_secs()).unwrap();
    let wanted = [
        (
            "nf_conntrack_tcp_timeout_established",
            secs(settings.tcp_established_timeout),
        ),
        (
            "nf_conntrack_tcp_timeout_close_wait",
            secs(settings.tcp_close_wait_timeout),
        ),
        ("nf_conntrack_tcp_be_liberal", 1),
        ("nf_conntrack_udp_timeout", secs(settings.udp_timeout)),
        (
            "nf_conntrack_udp_timeout_stream",
            secs(settings.udp_stream_timeout),
        ),
    ];
    for (file, value) in wanted {
        let got = read_back.iter().find(|(f, _)| *f == file).unwrap().1;
        assert_eq!(got, value, "{file} in the namespace");
    }
    // Each change is reported with the namespace's old value; be_liberal only when the
    // namespace did not start liberal already.
    let expected: Vec<(String, i64, i64)> = wanted
        .iter()
        .map(|(file, value)| {
            let old = start.iter().find(|(f, _)| f == file).unwrap().1;
            (format!("net.netfilter.{file}"), old, *value)
        })
        .filter(|(_, old, new)| old != new)
        .collect();
    let got: Vec<(String, i64, i64)> = changes
        .iter()
        .map(|(n, old, new)| ((*n).to_string(), *old, *new))
        .collect();
    assert_eq!(got, expected);
    assert!(got.len() >= 4, "{got:?}");

    // nf_conntrack_max: refused by the kernel (EACCES, mode 0444 outside the initial
    // namespace), reported as a warning naming it, and the rest still applied.
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    let (name, kind, text) = &warnings[0];
    assert_eq!(*name, "net.netfilter.nf_conntrack_max");
    assert_eq!(kind, "not permitted: EACCES", "{text}");
    assert!(text.contains("--init-only"), "{text}");
    assert_eq!(read("nf_conntrack_max"), host_max);

    // A second run changes nothing and still warns about the max only.
    assert_eq!(second, (0, vec!["net.netfilter.nf_conntrack_max"]));

    // The host's namespace never moved.
    assert_eq!(snapshot(), host_before);
}

fn describe(e: &NodeSetupError) -> String {
    match e {
        NodeSetupError::NotPermitted { source, .. } => format!(
            "not permitted: {}",
            source
                .raw_os_error()
                .map(nix::errno::Errno::from_raw)
                .map_or("no errno".to_string(), |e| format!("{e:?}"))
        ),
        other => format!("{other:?}"),
    }
}

/// `nodeproxy --init-only` as a privileged init container runs it: in a fresh network namespace
/// (`unshare -n`), it sets that namespace's conntrack timeouts and exits 0; the host's values do
/// not move. `--conntrack-max-per-core=0` keeps it off `nf_conntrack_max`, which only the
/// initial namespace may change.
#[test]
fn init_only_sets_the_namespaces_conntrack_timeouts_and_exits() {
    ensure_conntrack_loaded();
    let host = snapshot();
    let script = format!(
        "{} --init-only --conntrack-max-per-core=0 --conntrack-tcp-timeout-established=7h \
         --conntrack-udp-timeout 41s --conntrack-tcp-be-liberal && cat {NETFILTER}/nf_conntrack_tcp_timeout_established \
         {NETFILTER}/nf_conntrack_udp_timeout {NETFILTER}/nf_conntrack_tcp_be_liberal",
        env!("CARGO_BIN_EXE_nodeproxy")
    );
    let out = Command::new("unshare")
        .args(["-n", "sh", "-c", &script])
        .output()
        .unwrap_or_else(|e| panic!("unshare: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}\n{stdout}\n{stderr}", out.status);
    let values: Vec<&str> = stdout.split_whitespace().collect();
    assert_eq!(values, ["25200", "41", "1"], "{stderr}");
    assert!(
        stderr.contains("nf_conntrack_udp_timeout changed from"),
        "each change is logged:\n{stderr}"
    );
    assert_eq!(snapshot(), host, "the host's values changed");
}
