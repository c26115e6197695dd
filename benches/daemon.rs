//! Event → programmed latency of the daemon at scale: the real binary (release build) against
//! the fake API server (`tests/fakeapi`) loaded with N services × M endpoints, in a private
//! network namespace.
//!
//! Each update replaces the first endpoint of one Service's EndpointSlice with a new address
//! (10.255.x.y, never used by the generated cluster). "Programmed" is when the kernel announces
//! the new element: an `nft monitor` running in the namespace prints every element added, and
//! the line naming the new address is timestamped as it is read (polling `nft list` is far too
//! slow at this size, and the monitor sees every update without one process per poll). The
//! latency is from just before the fake API server applies the change (and streams it to the
//! daemon's watch) to that line.
//!
//! Phases: cold start (daemon start → first sync), idle (one update at a time, each after the
//! previous was programmed and `--min-sync-period` has passed, so none is throttled), two
//! slices (pairs of updates to two Services, sent while `--min-sync-period` holds the next
//! sync back, so one sync carries both; the daemon's log gives those syncs' lower + diff time),
//! churn (a steady rate of updates to distinct Services), then a relist (410 on every watch;
//! the VmRSS peak while the daemon lists everything again). CPU is utime+stime from
//! `/proc/<pid>/stat` over the churn period; memory is VmHWM / VmRSS from `/proc/<pid>/status`.
//!
//! Run as root: `sudo -E cargo bench --bench daemon` (environment: `NP_SERVICES` 10000,
//! `NP_ENDPOINTS` 10, `NP_IDLE_UPDATES` 100, `NP_PAIR_UPDATES` 30, `NP_CHURN_RATE` 100 per
//! second, `NP_CHURN_SECONDS` 10, `NP_MIN_SYNC_PERIOD` 1s, `NP_SYNC_PERIOD` 30s, `NP_MONITOR` 1;
//! 0 runs without the monitor, so without latencies, for sizes where its start-up takes
//! minutes; `NP_BINARY` the nodeproxy to run, by default this build's: the shipped binary of
//! `scripts/dist.sh` has another profile and is linked statically).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
// Percentiles and rates are float arithmetic rounded to counts and indexes.
#![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]

#[path = "../tests/fakeapi/mod.rs"]
mod fakeapi;

mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::net::Ipv4Addr;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{Killed, cpu_seconds, env_or, last_sync, service, slice, status_field};
use fakeapi::{FakeApi, Kind};

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn summary(what: &str, mut lat: Vec<Duration>, missing: usize) {
    lat.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "{what}: n={} missing={missing} p50={:.1} ms p90={:.1} ms p99={:.1} ms max={:.1} ms",
        lat.len(),
        ms(percentile(&lat, 0.5)),
        ms(percentile(&lat, 0.9)),
        ms(percentile(&lat, 0.99)),
        ms(lat.last().copied().unwrap_or_default()),
    );
}

fn run() {
    let services: usize = env_or("NP_SERVICES", 10_000);
    let endpoints: usize = env_or("NP_ENDPOINTS", 10);
    let idle_updates: usize = env_or("NP_IDLE_UPDATES", 100);
    let pair_updates: usize = env_or("NP_PAIR_UPDATES", 30);
    let monitor_on = env_or("NP_MONITOR", 1u8) != 0;
    let churn_rate: f64 = env_or("NP_CHURN_RATE", 100.0);
    let churn_seconds: f64 = env_or("NP_CHURN_SECONDS", 10.0);
    let min_sync: String = env_or("NP_MIN_SYNC_PERIOD", "1s".to_owned());
    let sync_period: String = env_or("NP_SYNC_PERIOD", "30s".to_owned());
    let binary: String = env_or("NP_BINARY", env!("CARGO_BIN_EXE_nodeproxy").to_owned());
    println!("binary: {binary}");
    let min_sync_d = common::duration_arg(&min_sync);

    let lo = Command::new("ip")
        .args(["link", "set", "lo", "up"])
        .status()
        .unwrap();
    assert!(lo.success());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let api = rt.block_on(FakeApi::start());
    api.apply(Kind::Node, common::node_a());
    for s in 0..services {
        api.apply(Kind::Service, service(s));
        api.apply(Kind::EndpointSlice, slice(s, endpoints, None));
    }
    let dir = std::env::temp_dir().join(format!("nodeproxy-bench-daemon-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let metrics = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let log = dir.join("daemon.log");
    let started = Instant::now();
    let daemon = Killed(
        Command::new(&binary)
            .arg("--kubeconfig")
            .arg(api.kubeconfig())
            .args([
                "--hostname-override",
                "node-a",
                "--cluster-cidr",
                "10.128.0.0/9",
            ])
            .arg("--lock-file")
            .arg(dir.join("lock"))
            .args(["--healthz-bind-address", ""])
            .args(["--metrics-bind-address", &format!("127.0.0.1:{metrics}")])
            .args([
                "--min-sync-period",
                &min_sync,
                "--sync-period",
                &sync_period,
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
    );
    let mut daemon = daemon;
    let pid = daemon.0.id();
    while last_sync(metrics) <= 0.0 {
        if let Ok(Some(status)) = daemon.0.try_wait() {
            panic!(
                "the daemon exited ({status}); log:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "no first sync; log:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    println!(
        "{services} services x {endpoints} endpoints, --min-sync-period {min_sync}, --sync-period {sync_period}"
    );
    println!(
        "cold: start -> first sync {:.2} s, cpu {:.2} s, VmHWM {}",
        started.elapsed().as_secs_f64(),
        cpu_seconds(pid),
        status_field(pid, "VmHWM:")
    );

    // The monitor: every added element, timestamped as read. Without it (NP_MONITOR=0: its
    // start-up cache load of the ruleset takes minutes at 50k Services) nothing measures
    // latency; updates are paced by --min-sync-period and the daemon's log is what counts.
    let (tx, seen) = mpsc::channel::<(Ipv4Addr, Instant)>();
    let mut monitor = None;
    if monitor_on {
        let mut m = Killed(
            Command::new("stdbuf")
                .args(["-oL", "nft", "monitor", "new", "elements"])
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        );
        let out = m.0.stdout.take().unwrap();
        monitor = Some(m);
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { return };
                let now = Instant::now();
                for word in line.split(|c: char| !(c.is_ascii_digit() || c == '.')) {
                    if word.starts_with("10.255.")
                        && let Ok(a) = word.parse::<Ipv4Addr>()
                        && tx.send((a, now)).is_err()
                    {
                        return;
                    }
                }
            }
        });
    }
    let unmonitored = || std::thread::sleep(min_sync_d + Duration::from_millis(300));
    // The monitor is listening, and the first update is not throttled by the first sync.
    std::thread::sleep(min_sync_d + Duration::from_millis(300));

    let mut next = 0u32;
    let mut update = |api: &FakeApi| -> (Ipv4Addr, Instant) {
        let i = next as usize;
        next += 1;
        let addr = Ipv4Addr::from(0x0AFF_0000u32 + next);
        // Distinct services (7919 is prime to 10000, and to most sizes).
        let s = (i * 7919) % services;
        let t = Instant::now();
        api.apply(Kind::EndpointSlice, slice(s, endpoints, Some(addr)));
        (addr, t)
    };

    // Warm-up, not counted: `nft monitor` reads the whole ruleset into its cache before it
    // subscribes (seconds at this size), missing what happens meanwhile; repeat an update
    // until the monitor reports one.
    let warm = Instant::now();
    'warm: loop {
        if !monitor_on {
            break;
        }
        assert!(
            warm.elapsed() < Duration::from_secs(120),
            "the monitor never started"
        );
        let (addr, t) = update(&api);
        while let Ok((a, _)) = seen
            .recv_timeout((t + Duration::from_secs(3)).saturating_duration_since(Instant::now()))
        {
            if a == addr {
                break 'warm;
            }
        }
    }
    if monitor_on {
        println!("monitor ready after {:.1} s", warm.elapsed().as_secs_f64());
    }
    std::thread::sleep(min_sync_d + Duration::from_millis(100));

    // Idle.
    let mut lat = Vec::new();
    let mut missing = 0;
    for _ in 0..idle_updates {
        let (addr, t) = update(&api);
        if !monitor_on {
            unmonitored();
            continue;
        }
        let deadline = t + Duration::from_secs(10);
        loop {
            match seen.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok((a, at)) if a == addr => {
                    lat.push(at - t);
                    break;
                }
                Ok(_) => {}
                Err(_) => {
                    missing += 1;
                    break;
                }
            }
        }
        // The sync that programmed it started before it was seen: waiting one
        // --min-sync-period after that (plus a margin) means the next one is not throttled.
        std::thread::sleep(min_sync_d + Duration::from_millis(100));
    }
    if monitor_on {
        summary("idle (one update at a time)", lat, missing);
    }
    while seen.try_recv().is_ok() {}

    // Two slices at once: two Services' updates applied back to back while --min-sync-period
    // holds the next sync back, so that sync carries both (issue 11's "two-slice incremental
    // sync"; the first pair, after the idle phase's pause, is not held back and is split); the
    // daemon's log says what each sync spent.
    let mut missing = 0;
    for _ in 0..pair_updates {
        let sent_at = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        let (a, t) = update(&api);
        let (b, _) = update(&api);
        if !monitor_on {
            // No monitor: the daemon's last-sync metric says when a sync followed the pair.
            while last_sync(metrics) < sent_at && t.elapsed() < Duration::from_secs(10) {
                std::thread::sleep(Duration::from_millis(20));
            }
            std::thread::sleep(min_sync_d / 2);
            continue;
        }
        let deadline = t + Duration::from_secs(10);
        let mut want = vec![a, b];
        while !want.is_empty() {
            match seen.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok((x, _)) => want.retain(|w| *w != x),
                Err(_) => {
                    missing += want.len();
                    break;
                }
            }
        }
        // Within --min-sync-period of the sync that programmed them: the next pair waits.
        std::thread::sleep(min_sync_d / 2);
    }
    println!("two slices at once: {pair_updates} pairs, {missing} update(s) not seen");
    while seen.try_recv().is_ok() {}

    // Churn: a steady rate, every update to a distinct Service.
    let count = (churn_rate * churn_seconds) as usize;
    let interval = Duration::from_secs_f64(1.0 / churn_rate);
    let cpu0 = cpu_seconds(pid);
    let t0 = Instant::now();
    let mut sent: HashMap<Ipv4Addr, Instant> = HashMap::new();
    let mut lat = Vec::new();
    for k in 0..count {
        let at = t0 + interval * k as u32;
        std::thread::sleep(at.saturating_duration_since(Instant::now()));
        let (addr, t) = update(&api);
        sent.insert(addr, t);
        while let Ok((a, seen_at)) = seen.try_recv() {
            if let Some(t) = sent.remove(&a) {
                lat.push(seen_at - t);
            }
        }
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    if !monitor_on {
        sent.clear();
        unmonitored();
    }
    while !sent.is_empty() {
        match seen.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok((a, seen_at)) => {
                if let Some(t) = sent.remove(&a) {
                    lat.push(seen_at - t);
                }
            }
            Err(_) => break,
        }
    }
    let wall = t0.elapsed().as_secs_f64();
    let cpu = cpu_seconds(pid) - cpu0;
    if monitor_on {
        summary(
            &format!("churn ({churn_rate}/s for {churn_seconds} s)"),
            lat,
            sent.len(),
        );
    }
    println!(
        "churn: cpu {cpu:.2} s over {wall:.2} s = {:.0} % of one core",
        cpu / wall * 100.0
    );
    // Idle CPU: the same wall time without changes (includes periodic verification syncs if
    // one falls in the window).
    let cpu1 = cpu_seconds(pid);
    std::thread::sleep(Duration::from_secs(5));
    println!("quiet: cpu {:.2} s over 5 s", cpu_seconds(pid) - cpu1);
    let hwm_kib = common::status_kib(pid, "VmHWM:");
    println!(
        "memory: VmHWM {}, VmRSS {} (RssAnon {}, RssFile {})",
        status_field(pid, "VmHWM:"),
        status_field(pid, "VmRSS:"),
        status_field(pid, "RssAnon:"),
        status_field(pid, "RssFile:")
    );
    // The daemon's own account of its syncs (info lines: syncs that changed something).
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    // The milliseconds a log line gives after `name` (`sync in `, `; lower `, `, diff `).
    let field = |l: &str, name: &str| -> Option<f64> {
        let rest = &l[l.find(name)? + name.len()..];
        rest[..rest.find(" ms")?].parse().ok()
    };
    let mut syncs: Vec<Duration> = text
        .lines()
        .filter_map(|l| Some(Duration::from_secs_f64(field(l, "sync in ")? / 1e3)))
        .collect();
    syncs.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "daemon's sync durations (log): n={} p50={:.1} ms p99={:.1} ms",
        syncs.len(),
        ms(percentile(&syncs, 0.5)),
        ms(percentile(&syncs, 0.99))
    );
    if let Some(l) = text.lines().rev().find(|l| l.contains("sync in ")) {
        println!("last sync logged: {}", l.trim());
    }
    // The syncs that carried exactly two changed EndpointSlices and nothing else: their
    // user-space work before the kernel (lower + diff, as the daemon logs them).
    let mut two: Vec<Duration> = text
        .lines()
        .filter(|l| l.contains("(0 Service, 2 EndpointSlice, 0 Node"))
        .filter_map(|l| {
            Some(Duration::from_secs_f64(
                (field(l, "; lower ")? + field(l, ", diff ")?) / 1e3,
            ))
        })
        .collect();
    two.sort();
    println!(
        "two-slice syncs (log): n={} lower+diff p50={:.2} ms p90={:.2} ms",
        two.len(),
        ms(percentile(&two, 0.5)),
        ms(percentile(&two, 0.9))
    );
    // For scripts/bench-kernel.sh.
    println!(
        "RESULT daemon_rss_kib={} daemon_hwm_kib={} two_slice_ms={:.3}",
        common::status_kib(pid, "VmRSS:"),
        hwm_kib,
        ms(percentile(&two, 0.5))
    );
    // A relist: every watch gets 410 and lists again (what a watch expiry makes a long-running
    // daemon do), with nothing changed. Its transient sits on top of the model and the applied
    // tables; VmRSS sampled every 2 ms for 4 s.
    let before = common::status_kib(pid, "VmRSS:");
    let lists = api.count(Kind::Service, false) + api.count(Kind::EndpointSlice, false);
    api.expire_watches();
    let t = Instant::now();
    let mut peak = before;
    while t.elapsed() < Duration::from_secs(4) {
        peak = peak.max(common::status_kib(pid, "VmRSS:"));
        std::thread::sleep(Duration::from_millis(2));
    }
    println!(
        "relist (410 on every watch): VmRSS {before} kB before, peak {peak} kB, {} kB after; \
         {} Service and EndpointSlice list request(s)",
        common::status_kib(pid, "VmRSS:"),
        api.count(Kind::Service, false) + api.count(Kind::EndpointSlice, false) - lists
    );
    drop(monitor);
    drop(daemon);
    drop(api);
    if std::env::var_os("NP_KEEP_LOG").is_some() {
        println!("daemon log kept: {}", log.display());
    } else {
        let _ = std::fs::remove_dir_all(&dir);
    }
}

fn main() {
    // `cargo bench` passes `--bench`; a plain `cargo test --benches` run must not need root.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let h = std::thread::spawn(|| {
        if let Err(e) = nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET) {
            panic!("unshare(CLONE_NEWNET) failed ({e}); run as root");
        }
        run();
    });
    if let Err(p) = h.join() {
        std::panic::resume_unwind(p);
    }
}
