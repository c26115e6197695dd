//! Unit tests of the node set-up against a temporary directory standing in for /proc/sys, /sys
//! and /proc/self: the machine's own settings are never written.

use std::sync::atomic::{AtomicUsize, Ordering};

use super::*;

/// A temporary /proc/sys + /sys + /proc/self, removed when dropped.
struct Root {
    dir: PathBuf,
}

const NETFILTER: &[(&str, i64)] = &[
    ("nf_conntrack_max", 65536),
    ("nf_conntrack_tcp_timeout_established", 432_000),
    ("nf_conntrack_tcp_timeout_close_wait", 60),
    ("nf_conntrack_tcp_be_liberal", 0),
    ("nf_conntrack_udp_timeout", 30),
    ("nf_conntrack_udp_timeout_stream", 120),
];

impl Root {
    /// A root holding the kernel's defaults for a small machine (`hashsize` 16384).
    fn new(name: &str) -> Root {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "nodeproxy-node-setup-{}-{}-{name}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("proc/sys/net/netfilter")).unwrap();
        std::fs::create_dir_all(dir.join("sys/module/nf_conntrack/parameters")).unwrap();
        std::fs::create_dir_all(dir.join("proc/self")).unwrap();
        let root = Root { dir };
        for (file, value) in NETFILTER {
            root.set(file, *value);
        }
        std::fs::write(root.hashsize_path(), "16384\n").unwrap();
        std::fs::write(root.proc_self().join("oom_score_adj"), "0\n").unwrap();
        root
    }

    fn proc_sys(&self) -> PathBuf {
        self.dir.join("proc/sys")
    }

    fn sys(&self) -> PathBuf {
        self.dir.join("sys")
    }

    fn proc_self(&self) -> PathBuf {
        self.dir.join("proc/self")
    }

    fn path(&self, file: &str) -> PathBuf {
        self.proc_sys().join("net/netfilter").join(file)
    }

    fn hashsize_path(&self) -> PathBuf {
        self.sys().join("module/nf_conntrack/parameters/hashsize")
    }

    fn set(&self, file: &str, value: i64) {
        std::fs::write(self.path(file), format!("{value}\n")).unwrap();
    }

    fn get(&self, file: &str) -> i64 {
        read_value(&self.path(file)).unwrap()
    }

    fn hashsize(&self) -> i64 {
        read_value(&self.hashsize_path()).unwrap()
    }

    /// Replaces a sysctl's file with a symlink to `target`.
    fn replace_with_link(&self, file: &str, target: &Path) {
        std::fs::remove_file(self.path(file)).unwrap();
        std::os::unix::fs::symlink(target, self.path(file)).unwrap();
    }

    fn apply(&self, cpus: usize, settings: &Conntrack) -> Report {
        apply(&self.proc_sys(), &self.sys(), cpus, settings)
    }
}

impl Drop for Root {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A file that even root may not write (mode 0444 in /proc/sys: the sysctl permission check
/// does not exempt root, unlike a regular file's mode) and that holds an integer. Writing to
/// it fails with EACCES, so it stands for a read-only /proc/sys without changing anything.
const READ_ONLY_FOR_ROOT: &str = "/proc/sys/kernel/cap_last_cap";

fn names(report: &Report) -> Vec<&'static str> {
    report.changes.iter().map(|c| c.name).collect()
}

/// Only timeouts and be_liberal, nothing that depends on the max.
fn timeouts_only() -> Conntrack {
    Conntrack {
        max_per_core: 0,
        min: 0,
        tcp_established_timeout: Duration::from_secs(7200),
        tcp_close_wait_timeout: Duration::from_secs(61),
        tcp_be_liberal: true,
        udp_timeout: Duration::from_secs(31),
        udp_stream_timeout: Duration::from_secs(121),
    }
}

#[test]
fn the_defaults_are_kube_proxys() {
    assert_eq!(
        Conntrack::default(),
        Conntrack {
            max_per_core: 32768,
            min: 131_072,
            tcp_established_timeout: Duration::from_secs(86400),
            tcp_close_wait_timeout: Duration::from_secs(3600),
            tcp_be_liberal: false,
            udp_timeout: Duration::ZERO,
            udp_stream_timeout: Duration::ZERO,
        }
    );
}

#[test]
fn the_max_is_per_core_times_cpus_or_the_min_whichever_is_larger() {
    let c = Conntrack::default();
    // 2 × 32768 = 65536 < 131072: the floor.
    assert_eq!(c.wanted_max(2), Some(131_072));
    assert_eq!(c.wanted_max(4), Some(131_072));
    // 8 × 32768 = 262144 > 131072: scaled.
    assert_eq!(c.wanted_max(8), Some(262_144));
    // No floor.
    let no_min = Conntrack {
        min: 0,
        ..c.clone()
    };
    assert_eq!(no_min.wanted_max(1), Some(32768));
    // maxPerCore 0 leaves the kernel's value whatever the min.
    let leave = Conntrack {
        max_per_core: 0,
        ..c.clone()
    };
    assert_eq!(leave.wanted_max(64), None);
    // Nothing to set when both come to 0 (upstream's `if max > 0`).
    assert_eq!(no_min.wanted_max(0), None);
}

#[test]
fn the_scaled_max_is_capped_at_1m_before_the_min_is_considered() {
    let c = Conntrack::default();
    // 512 × 32768 = 16M: upstream's TestGetConntrackMax_Capped.
    assert_eq!(c.wanted_max(512), Some(CONNTRACK_MAX_CAP));
    // Exactly at the cap is not capped.
    assert_eq!(c.wanted_max(32), Some(1_048_576));
    // As upstream: a min above the cap loses to the cap once the scaled value is above it...
    let big_min = Conntrack {
        min: 2_000_000,
        ..c.clone()
    };
    assert_eq!(big_min.wanted_max(64), Some(CONNTRACK_MAX_CAP));
    // ...and wins below it.
    assert_eq!(big_min.wanted_max(2), Some(2_000_000));
    // No overflow on absurd counts.
    let huge = Conntrack {
        max_per_core: u32::MAX,
        ..c
    };
    assert_eq!(huge.wanted_max(usize::MAX), Some(CONNTRACK_MAX_CAP));
}

#[test]
fn the_defaults_write_the_max_hashsize_and_tcp_timeouts_and_leave_udp() {
    let root = Root::new("defaults");
    let report = root.apply(2, &Conntrack::default());
    assert!(report.warnings.is_empty(), "{:?}", report.warnings);
    assert_eq!(
        report.changes,
        vec![
            Change {
                name: "net.netfilter.nf_conntrack_max",
                path: root.path("nf_conntrack_max"),
                old: 65536,
                new: 131_072,
            },
            Change {
                name: "nf_conntrack.hashsize",
                path: root.hashsize_path(),
                old: 16384,
                new: 32768,
            },
            Change {
                name: "net.netfilter.nf_conntrack_tcp_timeout_established",
                path: root.path("nf_conntrack_tcp_timeout_established"),
                old: 432_000,
                new: 86400,
            },
            Change {
                name: "net.netfilter.nf_conntrack_tcp_timeout_close_wait",
                path: root.path("nf_conntrack_tcp_timeout_close_wait"),
                old: 60,
                new: 3600,
            },
        ]
    );
    assert_eq!(root.get("nf_conntrack_max"), 131_072);
    assert_eq!(root.hashsize(), 32768);
    assert_eq!(root.get("nf_conntrack_tcp_timeout_established"), 86400);
    assert_eq!(root.get("nf_conntrack_tcp_timeout_close_wait"), 3600);
    // Zero UDP timeouts and be_liberal false leave the kernel's values.
    assert_eq!(root.get("nf_conntrack_udp_timeout"), 30);
    assert_eq!(root.get("nf_conntrack_udp_timeout_stream"), 120);
    assert_eq!(root.get("nf_conntrack_tcp_be_liberal"), 0);
    assert_eq!(
        report.changes[0].to_string(),
        "net.netfilter.nf_conntrack_max changed from 65536 to 131072"
    );
}

#[test]
fn values_already_in_place_are_not_written_again() {
    let root = Root::new("again");
    let settings = Conntrack {
        udp_timeout: Duration::from_secs(31),
        tcp_be_liberal: true,
        ..Conntrack::default()
    };
    assert_eq!(root.apply(2, &settings).changes.len(), 6);
    // Files that are not written keep their modification time; make any write visible by
    // setting an old one first.
    let old = std::time::SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
    let mut paths: Vec<PathBuf> = NETFILTER.iter().map(|(f, _)| root.path(f)).collect();
    paths.push(root.hashsize_path());
    for p in &paths {
        std::fs::File::options()
            .write(true)
            .open(p)
            .unwrap()
            .set_modified(old)
            .unwrap();
    }
    let report = root.apply(2, &settings);
    assert!(report.changes.is_empty(), "{:?}", report.changes);
    assert!(report.warnings.is_empty(), "{:?}", report.warnings);
    for p in &paths {
        assert_eq!(
            std::fs::metadata(p).unwrap().modified().unwrap(),
            old,
            "{} was written",
            p.display()
        );
    }
}

#[test]
fn timeouts_are_written_when_they_differ_in_either_direction() {
    let root = Root::new("differ");
    root.set("nf_conntrack_tcp_timeout_established", 10);
    root.set("nf_conntrack_tcp_timeout_close_wait", 999_999);
    let report = root.apply(2, &timeouts_only());
    assert!(report.warnings.is_empty(), "{:?}", report.warnings);
    assert_eq!(
        names(&report),
        [
            "net.netfilter.nf_conntrack_tcp_timeout_established",
            "net.netfilter.nf_conntrack_tcp_timeout_close_wait",
            "net.netfilter.nf_conntrack_tcp_be_liberal",
            "net.netfilter.nf_conntrack_udp_timeout",
            "net.netfilter.nf_conntrack_udp_timeout_stream",
        ]
    );
    assert_eq!(root.get("nf_conntrack_tcp_timeout_established"), 7200);
    assert_eq!(root.get("nf_conntrack_tcp_timeout_close_wait"), 61);
    assert_eq!(root.get("nf_conntrack_tcp_be_liberal"), 1);
    assert_eq!(root.get("nf_conntrack_udp_timeout"), 31);
    assert_eq!(root.get("nf_conntrack_udp_timeout_stream"), 121);
}

#[test]
fn the_max_and_hashsize_are_raised_never_lowered() {
    let root = Root::new("raise");
    // Larger than the 131072 and 32768 wanted for 2 CPUs: both stay.
    root.set("nf_conntrack_max", 262_144);
    std::fs::write(root.hashsize_path(), "65536").unwrap();
    let report = root.apply(2, &Conntrack::default());
    assert!(!names(&report).contains(&"net.netfilter.nf_conntrack_max"));
    assert!(!names(&report).contains(&"nf_conntrack.hashsize"));
    assert_eq!(root.get("nf_conntrack_max"), 262_144);
    assert_eq!(root.hashsize(), 65536);

    // A max already large enough does not keep a small hash size: it is raised on its own,
    // as upstream does.
    std::fs::write(root.hashsize_path(), "1024").unwrap();
    let report = root.apply(2, &Conntrack::default());
    assert_eq!(
        report
            .changes
            .iter()
            .map(|c| (c.name, c.old, c.new))
            .collect::<Vec<_>>(),
        [("nf_conntrack.hashsize", 1024, 32768)]
    );
    assert_eq!(root.get("nf_conntrack_max"), 262_144);

    // Scaled by CPUs: 16 × 32768.
    let report = root.apply(16, &Conntrack::default());
    assert_eq!(
        report
            .changes
            .iter()
            .map(|c| (c.name, c.old, c.new))
            .collect::<Vec<_>>(),
        [
            ("net.netfilter.nf_conntrack_max", 262_144, 524_288),
            ("nf_conntrack.hashsize", 32768, 131_072),
        ]
    );
}

#[test]
fn max_per_core_zero_leaves_the_max_and_the_hashsize() {
    let root = Root::new("leave-max");
    root.set("nf_conntrack_max", 1);
    std::fs::write(root.hashsize_path(), "1").unwrap();
    let settings = Conntrack {
        max_per_core: 0,
        ..Conntrack::default()
    };
    let report = root.apply(64, &settings);
    assert!(report.warnings.is_empty(), "{:?}", report.warnings);
    assert_eq!(root.get("nf_conntrack_max"), 1);
    assert_eq!(root.hashsize(), 1);
    assert!(
        report
            .changes
            .iter()
            .all(|c| c.name.contains("tcp_timeout")),
        "{:?}",
        report.changes
    );
}

#[test]
fn zero_and_sub_second_timeouts_leave_the_kernels_values() {
    let root = Root::new("zero");
    let settings = Conntrack {
        max_per_core: 0,
        min: 0,
        tcp_established_timeout: Duration::ZERO,
        tcp_close_wait_timeout: Duration::from_millis(999),
        tcp_be_liberal: false,
        udp_timeout: Duration::ZERO,
        udp_stream_timeout: Duration::from_millis(500),
    };
    let report = root.apply(2, &settings);
    assert!(report.changes.is_empty(), "{:?}", report.changes);
    assert!(report.warnings.is_empty(), "{:?}", report.warnings);
    for (file, value) in NETFILTER {
        assert_eq!(root.get(file), *value, "{file}");
    }
}

#[test]
fn be_liberal_is_only_ever_set_to_one() {
    let root = Root::new("liberal");
    root.set("nf_conntrack_tcp_be_liberal", 1);
    // false does not turn off what the node has.
    let report = root.apply(
        2,
        &Conntrack {
            tcp_be_liberal: false,
            ..timeouts_only()
        },
    );
    assert!(!names(&report).contains(&"net.netfilter.nf_conntrack_tcp_be_liberal"));
    assert_eq!(root.get("nf_conntrack_tcp_be_liberal"), 1);
    // true when already 1 writes nothing.
    let report = root.apply(2, &timeouts_only());
    assert!(!names(&report).contains(&"net.netfilter.nf_conntrack_tcp_be_liberal"));
}

#[test]
fn a_read_only_sysctl_is_a_warning_naming_it_and_the_others_are_still_set() {
    let root = Root::new("read-only");
    // The first and a middle setting are read-only: neither stops what follows.
    root.replace_with_link("nf_conntrack_max", Path::new(READ_ONLY_FOR_ROOT));
    root.replace_with_link(
        "nf_conntrack_tcp_timeout_established",
        Path::new(READ_ONLY_FOR_ROOT),
    );
    let before = std::fs::read_to_string(READ_ONLY_FOR_ROOT).unwrap();
    let report = root.apply(2, &Conntrack::default());
    assert_eq!(std::fs::read_to_string(READ_ONLY_FOR_ROOT).unwrap(), before);

    assert_eq!(report.warnings.len(), 2, "{:?}", report.warnings);
    let w = &report.warnings[0];
    assert_eq!(w.name, "net.netfilter.nf_conntrack_max");
    assert!(
        matches!(&w.error, NodeSetupError::NotPermitted { path, wanted: 131_072, source, .. }
            if *path == root.path("nf_conntrack_max")
                && source.raw_os_error() == Some(Errno::EACCES as i32)),
        "{w:?}"
    );
    let text = w.to_string();
    for part in [
        "net.netfilter.nf_conntrack_max left as it is",
        &root.path("nf_conntrack_max").display().to_string(),
        "not allowed to write 131072",
        "privileged",
        "--init-only",
        "host's network namespace",
    ] {
        assert!(text.contains(part), "{part:?} not in {text:?}");
    }
    assert_eq!(
        report.warnings[1].name,
        "net.netfilter.nf_conntrack_tcp_timeout_established"
    );
    // Everything else was applied.
    assert_eq!(
        names(&report),
        [
            "nf_conntrack.hashsize",
            "net.netfilter.nf_conntrack_tcp_timeout_close_wait",
        ]
    );
    assert_eq!(root.hashsize(), 32768);
    assert_eq!(root.get("nf_conntrack_tcp_timeout_close_wait"), 3600);
}

#[test]
fn a_read_only_sys_leaves_the_hashsize_with_a_warning() {
    let root = Root::new("read-only-sys");
    let hashsize = root.hashsize_path();
    std::fs::remove_file(&hashsize).unwrap();
    std::os::unix::fs::symlink(READ_ONLY_FOR_ROOT, &hashsize).unwrap();
    let report = root.apply(2, &Conntrack::default());
    assert_eq!(report.warnings.len(), 1, "{:?}", report.warnings);
    assert_eq!(report.warnings[0].name, "nf_conntrack.hashsize");
    assert!(matches!(
        report.warnings[0].error,
        NodeSetupError::NotPermitted { .. }
    ));
    assert_eq!(
        names(&report),
        [
            "net.netfilter.nf_conntrack_max",
            "net.netfilter.nf_conntrack_tcp_timeout_established",
            "net.netfilter.nf_conntrack_tcp_timeout_close_wait",
        ]
    );
}

#[test]
fn unreadable_and_malformed_files_are_warnings_per_sysctl() {
    let root = Root::new("broken");
    // Missing (the module not loaded): a dangling symlink into a directory that does not exist.
    root.replace_with_link(
        "nf_conntrack_max",
        &root.dir.join("no-such-dir/nf_conntrack_max"),
    );
    // A directory where the file should be.
    std::fs::remove_file(root.path("nf_conntrack_tcp_timeout_established")).unwrap();
    std::fs::create_dir(root.path("nf_conntrack_tcp_timeout_established")).unwrap();
    // Not an integer.
    std::fs::write(root.path("nf_conntrack_tcp_timeout_close_wait"), "sixty\n").unwrap();
    let report = root.apply(2, &timeouts_only_with_max());

    let got: Vec<(&str, &str)> = report
        .warnings
        .iter()
        .map(|w| {
            let kind = match &w.error {
                NodeSetupError::Read { source, .. } if source.kind() == io::ErrorKind::NotFound => {
                    "not found"
                }
                NodeSetupError::Read { .. } => "read",
                NodeSetupError::Parse { found, .. } if found == "sixty" => "parse",
                other => panic!("unexpected {other:?}"),
            };
            (w.name, kind)
        })
        .collect();
    assert_eq!(
        got,
        [
            ("net.netfilter.nf_conntrack_max", "not found"),
            ("net.netfilter.nf_conntrack_tcp_timeout_established", "read"),
            ("net.netfilter.nf_conntrack_tcp_timeout_close_wait", "parse"),
        ]
    );
    for w in &report.warnings {
        let text = w.to_string();
        assert!(text.starts_with(w.name), "{text}");
        assert!(
            text.contains(&root.proc_sys().display().to_string()),
            "{text}"
        );
    }
    // Nothing was created in place of the missing file.
    assert!(!root.dir.join("no-such-dir").exists());
    // The rest was applied.
    assert_eq!(
        names(&report),
        [
            "nf_conntrack.hashsize",
            "net.netfilter.nf_conntrack_tcp_be_liberal",
            "net.netfilter.nf_conntrack_udp_timeout",
            "net.netfilter.nf_conntrack_udp_timeout_stream",
        ]
    );
}

fn timeouts_only_with_max() -> Conntrack {
    Conntrack {
        max_per_core: 32768,
        min: 131_072,
        ..timeouts_only()
    }
}

#[test]
fn kernel_refusals_get_the_remedy_and_other_write_errors_do_not() {
    let path = Path::new("/proc/sys/net/netfilter/nf_conntrack_max");
    for errno in [Errno::EROFS, Errno::EACCES, Errno::EPERM, Errno::EOPNOTSUPP] {
        let e = write_error(
            path,
            1,
            io::Error::from_raw_os_error(errno as i32),
            SYSCTL_REMEDY,
        );
        assert!(
            matches!(e, NodeSetupError::NotPermitted { .. }),
            "{errno}: {e:?}"
        );
    }
    let e = write_error(
        path,
        1,
        io::Error::from_raw_os_error(Errno::EINVAL as i32),
        SYSCTL_REMEDY,
    );
    assert!(matches!(e, NodeSetupError::Write { .. }), "{e:?}");
    assert!(!e.to_string().contains("privileged"), "{e}");
    assert!(e.to_string().contains(&path.display().to_string()), "{e}");
}

#[test]
fn oom_score_adj_is_written_only_when_different() {
    let root = Root::new("oom");
    let file = root.proc_self().join("oom_score_adj");
    assert_eq!(
        set_oom_score_adj(&root.proc_self(), -999).unwrap(),
        Some((0, -999))
    );
    assert_eq!(read_value(&file).unwrap(), -999);
    assert_eq!(set_oom_score_adj(&root.proc_self(), -999).unwrap(), None);
    assert_eq!(
        set_oom_score_adj(&root.proc_self(), 1000).unwrap(),
        Some((-999, 1000))
    );
    assert_eq!(
        set_oom_score_adj(&root.proc_self(), -1000).unwrap(),
        Some((1000, -1000))
    );
}

#[test]
fn oom_score_adj_out_of_range_is_refused_before_touching_the_file() {
    let root = Root::new("oom-range");
    for value in [-1001, 1001, i32::MIN, i32::MAX] {
        let e = set_oom_score_adj(&root.proc_self(), value).unwrap_err();
        assert!(
            matches!(e, NodeSetupError::OomScoreAdjRange { value: v, .. } if v == value),
            "{e:?}"
        );
        let text = e.to_string();
        assert!(text.contains("oom_score_adj"), "{text}");
        assert!(text.contains("-1000..=1000"), "{text}");
    }
    assert_eq!(
        read_value(&root.proc_self().join("oom_score_adj")).unwrap(),
        0
    );
}

#[test]
fn oom_score_adj_errors_name_the_file() {
    let root = Root::new("oom-errors");
    let file = root.proc_self().join("oom_score_adj");
    std::fs::remove_file(&file).unwrap();
    let e = set_oom_score_adj(&root.proc_self(), -999).unwrap_err();
    assert!(matches!(e, NodeSetupError::Read { .. }), "{e:?}");
    assert!(e.to_string().contains(&file.display().to_string()), "{e}");

    std::os::unix::fs::symlink(READ_ONLY_FOR_ROOT, &file).unwrap();
    let e = set_oom_score_adj(&root.proc_self(), -999).unwrap_err();
    assert!(matches!(e, NodeSetupError::NotPermitted { .. }), "{e:?}");
    assert!(
        e.remedy().is_some_and(|r| r.contains("CAP_SYS_RESOURCE")),
        "{e:?}"
    );
}

#[test]
fn cpu_lists_are_counted_as_the_kernel_writes_them() {
    assert_eq!(count_cpu_list("0\n"), Some(1));
    assert_eq!(count_cpu_list("0-1\n"), Some(2));
    assert_eq!(count_cpu_list("0-3,8,10-11\n"), Some(7));
    assert_eq!(count_cpu_list(""), None);
    assert_eq!(count_cpu_list("3-1"), None);
    assert_eq!(count_cpu_list("a-b"), None);
    assert_eq!(count_cpu_list("0,,1"), None);
}

#[test]
fn online_cpus_counts_this_machines_cpus() {
    let online = online_cpus();
    assert!(online >= 1);
    // Never fewer than this process may run on: the node-wide count includes them.
    assert!(online >= affinity_cpus().unwrap_or(1), "{online}");
}
