//! The soak: the daemon (release build) against the fake API server (`tests/fakeapi`) at 10k
//! Services for MINUTES, under every disturbance a node sees, in a private network namespace.
//!
//! Throughout: endpoint churn (`NP_CHURN_RATE` EndpointSlice changes per second to random
//! Services), a Service added and an old one removed every 3 s, and a client opening a TCP
//! connection to the `soak/echo` Service every 100 ms (its endpoints are addresses of this
//! namespace, served by a listener here; one of its three endpoints is replaced every 5 s). In
//! turn, 3 s apart: the watches' connections dropped, an API outage of 10 s (with changes made
//! meanwhile), every watch expired (410, relist), `nft flush ruleset`, and elements deleted by
//! hand (the daemon runs with `--table-ownership off`, so others can change its table).
//!
//! After each disturbance the changes go on for one `--sync-period`; then they stop and the
//! kernel is compared with the desired state (the fake API's objects, built and lowered by the
//! library as the daemon would, read back and diffed): it must match within a margin for the
//! last sync. So a disturbance is repaired within one sync period even while changes keep
//! coming. A client connection may fail only while someone else's `nft` has removed our rules
//! (from the removal until the kernel matched again; the time until the client first got
//! through again is reported); any other failure fails the soak, as do more drift repairs
//! counted than the removals can explain. RSS and open file descriptors
//! are sampled every 5 s: the last quarter of the run may not hold more than the second quarter
//! (10 % + 4 MiB, 2 descriptors).
//!
//! Writes `target/soak/samples.csv` and `target/soak/soak.svg` (RSS, sync time and repairs over
//! time). Run as root: `scripts/soak.sh MINUTES` (environment: `NP_SERVICES` 10000,
//! `NP_ENDPOINTS` 10, `NP_CHURN_RATE` 20, `NP_SYNC_PERIOD` 10s, `NP_MIN_SYNC_PERIOD` 1s).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "../tests/fakeapi/mod.rs"]
mod fakeapi;

mod common;

use std::collections::{BTreeMap, VecDeque};
use std::ffi::OsString;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{Killed, duration_arg, env_or, metric, scrape, service, slice, status_kib};
use fakeapi::{FakeApi, Kind};
use nodeproxy::nft::{Kernel, NetlinkKernel, diff, lower_owned, size_sets};
use nodeproxy::ruleset::{self, Settings};
use serde_json::{Value, json};

const ECHO_IP: &str = "10.97.0.1";
/// The echo Service's endpoint pool: three of them are in its slice at any time, all six are
/// served, so a connection is judged by the rules alone.
const ECHO_POOL: [&str; 6] = [
    "203.0.113.1",
    "203.0.113.2",
    "203.0.113.3",
    "203.0.113.4",
    "203.0.113.5",
    "203.0.113.6",
];

fn sh(cmd: &str) {
    let st = Command::new("sh").args(["-c", cmd]).status().unwrap();
    assert!(st.success(), "`{cmd}` failed");
}

/// The fake API's objects as the soak last set them: what the kernel must converge to.
struct World {
    api: FakeApi,
    services: usize,
    endpoints: usize,
    objects: BTreeMap<(Kind, String), Value>,
    /// Services added during the soak (numbered from `services`), oldest first.
    added: VecDeque<usize>,
    next_added: usize,
    echo: VecDeque<usize>,
    next_echo: usize,
    changes: u64,
    seed: u64,
}

impl World {
    fn key(kind: Kind, obj: &Value) -> (Kind, String) {
        let m = &obj["metadata"];
        (
            kind,
            format!(
                "{}/{}",
                m["namespace"].as_str().unwrap_or(""),
                m["name"].as_str().unwrap()
            ),
        )
    }

    fn apply(&mut self, kind: Kind, obj: Value) {
        self.api.apply(kind, obj.clone());
        self.objects.insert(Self::key(kind, &obj), obj);
        self.changes += 1;
    }

    fn delete(&mut self, kind: Kind, obj: &Value) {
        let (k, name) = Self::key(kind, obj);
        let (ns, n) = name.split_once('/').unwrap();
        self.api.delete(kind, ns, n);
        self.objects.remove(&(k, name));
        self.changes += 1;
    }

    fn random(&mut self) -> u64 {
        // xorshift: repeatable runs without another dependency.
        self.seed ^= self.seed << 13;
        self.seed ^= self.seed >> 7;
        self.seed ^= self.seed << 17;
        self.seed
    }

    /// One endpoint of a random generated Service replaced by a fresh address.
    fn churn(&mut self) {
        let s = usize::try_from(self.random() % self.services as u64).unwrap();
        let addr = Ipv4Addr::from(0x0AFF_0000u32 + u32::try_from(self.changes & 0xFFFF).unwrap());
        self.apply(Kind::EndpointSlice, slice(s, self.endpoints, Some(addr)));
    }

    /// A new Service with its slice; the oldest added one goes once there are 20.
    fn add_and_remove_service(&mut self) {
        let s = self.next_added;
        self.next_added += 1;
        self.apply(Kind::Service, service(s));
        self.apply(Kind::EndpointSlice, slice(s, self.endpoints, None));
        self.added.push_back(s);
        if self.added.len() > 20
            && let Some(old) = self.added.pop_front()
        {
            self.delete(Kind::EndpointSlice, &slice(old, self.endpoints, None));
            self.delete(Kind::Service, &service(old));
        }
    }

    fn echo_slice(&self) -> Value {
        let eps: Vec<Value> = self
            .echo
            .iter()
            .map(|&i| json!({"addresses": [ECHO_POOL[i]], "conditions": {"ready": true}, "nodeName": "node-a"}))
            .collect();
        json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
               "metadata": {"namespace": "soak", "name": "echo-1",
                            "labels": {"kubernetes.io/service-name": "echo"}},
               "addressType": "IPv4",
               "ports": [{"name": "http", "protocol": "TCP", "port": 8080}],
               "endpoints": eps})
    }

    /// The echo Service's oldest endpoint replaced by the next one of the pool.
    fn rotate_echo(&mut self) {
        self.echo.pop_front();
        self.echo.push_back(self.next_echo % ECHO_POOL.len());
        self.next_echo += 1;
        let s = self.echo_slice();
        self.apply(Kind::EndpointSlice, s);
    }

    /// The objects as one `List`, read by the library exactly as `--from-file` reads them.
    fn as_list(&self) -> String {
        let items: Vec<&Value> = self.objects.values().collect();
        serde_json::to_string(&json!({"apiVersion": "v1", "kind": "List", "items": items})).unwrap()
    }
}

/// The daemon's flags; the soak builds the desired state from the same ones.
fn daemon_args(dir: &Path, kubeconfig: &Path, metrics: u16) -> Vec<OsString> {
    let sync_period: String = env_or("NP_SYNC_PERIOD", "10s".to_owned());
    let min_sync: String = env_or("NP_MIN_SYNC_PERIOD", "1s".to_owned());
    let mut args: Vec<OsString> = vec!["--kubeconfig".into(), kubeconfig.into()];
    for a in [
        "--hostname-override",
        "node-a",
        "--cluster-cidr",
        "10.128.0.0/9",
        "--table-ownership",
        "off",
        "--healthz-bind-address",
        "",
        "--metrics-bind-address",
        &format!("127.0.0.1:{metrics}"),
        "--min-sync-period",
        &min_sync,
        "--sync-period",
        &sync_period,
        "--lock-file",
    ] {
        args.push(a.into());
    }
    args.push(dir.join("lock").into());
    args
}

/// Compares the kernel with the desired state: `None` when they match, else what a sync would
/// still have to do.
fn divergence(world: &World, settings: &Settings) -> Option<String> {
    let loaded = nodeproxy::source::file::load_text(Path::new("soak"), &world.as_list()).unwrap();
    assert!(
        loaded.rejected.is_empty(),
        "the soak's own objects were rejected: {:?}",
        loaded.rejected
    );
    let desired = ruleset::build(&loaded.state, settings);
    let mut kernel = NetlinkKernel::new().unwrap();
    let mut out = Vec::new();
    for table in desired.tables {
        let family = table.family;
        let mut want = lower_owned(table).unwrap();
        let have = kernel.read_table(family, &want.name).unwrap();
        // As every sync does: a big set keeps the size the kernel holds while its count stays
        // within the margin (`nft::size_sets`), so a fresh size is no divergence.
        size_sets(&mut want, have.as_ref());
        let plan = diff(have.as_ref(), &want);
        if !plan.is_empty() {
            let mut kinds: BTreeMap<&str, usize> = BTreeMap::new();
            for op in plan.ops() {
                *kinds.entry(op.kind()).or_default() += 1;
            }
            out.push(format!("{}: {kinds:?}", plan.table_desc()));
        }
    }
    (!out.is_empty()).then(|| out.join("; "))
}

#[derive(Default)]
struct Client {
    ok: u64,
    failed: u64,
    /// Failures outside a window in which our rules were removed by someone else.
    unexcused: Vec<String>,
    excused: u64,
    /// When our rules were last removed by hand, until a connection got through again.
    outage_since: Option<Instant>,
    /// From each removal to the first connection that got through again.
    outages: Vec<f64>,
}

/// One client connection through the echo Service: the endpoint's answer.
fn connect_echo() -> Result<String, String> {
    let addr = format!("{ECHO_IP}:80").parse().unwrap();
    let mut s =
        TcpStream::connect_timeout(&addr, Duration::from_secs(2)).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(2)))
        .map_err(|e| e.to_string())?;
    let mut answer = String::new();
    s.read_to_string(&mut answer).map_err(|e| e.to_string())?;
    if answer.starts_with("203.0.113.") {
        Ok(answer)
    } else {
        Err(format!("unexpected answer {answer:?}"))
    }
}

struct Sample {
    t: f64,
    rss_kib: u64,
    fds: usize,
    syncs: f64,
    sync_seconds: f64,
    repairs: f64,
    client_ok: u64,
    client_failed: u64,
}

fn run(minutes: f64) -> Result<(), String> {
    let services: usize = env_or("NP_SERVICES", 10_000);
    let endpoints: usize = env_or("NP_ENDPOINTS", 10);
    let churn_rate: f64 = env_or("NP_CHURN_RATE", 20.0);
    let sync_period = duration_arg(&env_or("NP_SYNC_PERIOD", "10s".to_owned()));
    let out_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/soak");
    std::fs::create_dir_all(&out_dir).unwrap();

    // The namespace's network: the node's address and the echo endpoints on a veth (no dummy
    // module on every machine), and a route for the Service range so a connection to a
    // ClusterIP gets as far as the nat output hook.
    sh("ip link set lo up \
        && ip link add soak0 type veth peer name soak1 \
        && ip link set soak0 up && ip link set soak1 up \
        && ip addr add 192.0.2.11/24 dev soak0 \
        && ip route add 10.96.0.0/12 dev soak0");
    for a in ECHO_POOL {
        sh(&format!("ip addr add {a}/32 dev soak0"));
    }
    let listener = TcpListener::bind("0.0.0.0:8080").unwrap();
    std::thread::spawn(move || {
        for mut c in listener.incoming().flatten() {
            let local = c
                .local_addr()
                .map(|a| a.ip().to_string())
                .unwrap_or_default();
            let _ = c.write_all(local.as_bytes());
        }
    });

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let api = rt.block_on(FakeApi::start());
    let mut world = World {
        api,
        services,
        endpoints,
        objects: BTreeMap::new(),
        added: VecDeque::new(),
        next_added: services,
        echo: VecDeque::from([0, 1, 2]),
        next_echo: 3,
        changes: 0,
        seed: 0x9E37_79B9_7F4A_7C15,
    };
    world.apply(Kind::Node, common::node_a());
    for s in 0..services {
        world.apply(Kind::Service, service(s));
        world.apply(Kind::EndpointSlice, slice(s, endpoints, None));
    }
    world.apply(
        Kind::Service,
        json!({"apiVersion": "v1", "kind": "Service",
               "metadata": {"namespace": "soak", "name": "echo"},
               "spec": {"type": "ClusterIP", "clusterIP": ECHO_IP, "clusterIPs": [ECHO_IP],
                        "ports": [{"name": "http", "protocol": "TCP", "port": 80, "targetPort": 8080}]}}),
    );
    let echo = world.echo_slice();
    world.apply(Kind::EndpointSlice, echo);

    let dir = std::env::temp_dir().join(format!("nodeproxy-soak-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let metrics = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let args = daemon_args(&dir, world.api.kubeconfig(), metrics);
    let mut cli: Vec<OsString> = vec!["nodeproxy".into()];
    cli.extend(args.iter().cloned());
    let loaded = nodeproxy::config::load(cli, &|_| None).unwrap();
    let settings = Settings::new(&loaded.config, "node-a".to_owned());
    let log = dir.join("daemon.log");
    let mut daemon = Killed(
        Command::new(env!("CARGO_BIN_EXE_nodeproxy"))
            .args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
    );
    let pid = daemon.0.id();
    let daemon_log = || std::fs::read_to_string(&log).unwrap_or_default();
    let started = Instant::now();
    while common::last_sync(metrics) <= 0.0 {
        if let Ok(Some(status)) = daemon.0.try_wait() {
            return Err(format!(
                "the daemon exited ({status}); log:\n{}",
                daemon_log()
            ));
        }
        if started.elapsed() > Duration::from_secs(120) {
            return Err(format!("no first sync in 120 s; log:\n{}", daemon_log()));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    println!(
        "soak: {services} services x {endpoints} endpoints, first sync after {:.2} s; \
         {minutes} min, churn {churn_rate}/s, --sync-period {:?}",
        started.elapsed().as_secs_f64(),
        sync_period
    );

    // The client: a connection every 100 ms, judged against the windows in which our rules
    // were removed by hand (`tampered`: from the removal until the kernel matched again).
    let client = Arc::new(Mutex::new(Client::default()));
    let tampered = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let client_thread = {
        let (client, tampered, stop) = (client.clone(), tampered.clone(), stop.clone());
        let t0 = Instant::now();
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let during_tamper = tampered.load(Ordering::SeqCst);
                let result = connect_echo();
                let after_tamper = tampered.load(Ordering::SeqCst);
                let mut c = client.lock().unwrap();
                match result {
                    Ok(_) => {
                        c.ok += 1;
                        if let Some(since) = c.outage_since.take() {
                            c.outages.push(since.elapsed().as_secs_f64());
                        }
                    }
                    Err(e) => {
                        c.failed += 1;
                        if during_tamper || after_tamper {
                            c.excused += 1;
                        } else {
                            c.unexcused
                                .push(format!("t={:.1}s: {e}", t0.elapsed().as_secs_f64()));
                        }
                    }
                }
                drop(c);
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };

    let t0 = Instant::now();
    let end = t0 + Duration::from_secs_f64(minutes * 60.0);
    let mut samples: Vec<Sample> = Vec::new();
    let mut failures: Vec<String> = Vec::new();
    let mut convergence: BTreeMap<&'static str, Vec<f64>> = BTreeMap::new();
    let churn_interval = Duration::from_secs_f64(1.0 / churn_rate);
    let mut next_churn = Instant::now();
    let mut next_service = Instant::now();
    let mut next_echo = Instant::now();
    let mut next_sample = Instant::now();
    // In turn, each 3 s after the previous one's check.
    let schedule: [&'static str; 5] = [
        "watch connections dropped",
        "API outage (10 s)",
        "watches expired (410)",
        "nft flush ruleset",
        "elements deleted by hand",
    ];
    let mut disturbances = 0usize;
    let mut next_disturbance = Instant::now() + Duration::from_secs(3);
    let mut outage_until: Option<Instant> = None;
    // The disturbance whose aftermath is checked, and when: one sync period after it, during
    // which the changes go on.
    let mut check: Option<(&'static str, Instant)> = None;
    let sample = |samples: &mut Vec<Sample>| {
        let text = scrape(metrics);
        let c = client.lock().unwrap();
        samples.push(Sample {
            t: t0.elapsed().as_secs_f64(),
            rss_kib: status_kib(pid, "VmRSS:"),
            fds: std::fs::read_dir(format!("/proc/{pid}/fd"))
                .map(|d| d.count())
                .unwrap_or(0),
            syncs: metric(&text, "kubeproxy_sync_proxy_rules_duration_seconds_count"),
            sync_seconds: metric(&text, "kubeproxy_sync_proxy_rules_duration_seconds_sum"),
            repairs: metric(&text, "nodeproxy_drift_repairs_total"),
            client_ok: c.ok,
            client_failed: c.failed,
        });
    };
    while Instant::now() < end {
        if let Ok(Some(status)) = daemon.0.try_wait() {
            failures.push(format!("the daemon exited ({status})"));
            break;
        }
        let now = Instant::now();
        if now >= next_sample {
            sample(&mut samples);
            next_sample += Duration::from_secs(5);
        }
        if let Some(until) = outage_until
            && now >= until
        {
            rt.block_on(world.api.come_back());
            outage_until = None;
            check = Some(("API outage (10 s)", Instant::now() + sync_period));
        }
        if let Some((what, at)) = check
            && now >= at
        {
            converge(
                what,
                &world,
                &settings,
                &tampered,
                &mut convergence,
                &mut failures,
            );
            check = None;
            next_churn = Instant::now();
            next_disturbance = Instant::now() + Duration::from_secs(3);
            continue;
        }
        if check.is_none() && outage_until.is_none() && now >= next_disturbance {
            let i = disturbances % schedule.len();
            disturbances += 1;
            let what = schedule[i];
            match i {
                0 => world.api.drop_connections(),
                1 => {
                    world.api.go_down();
                    outage_until = Some(Instant::now() + Duration::from_secs(10));
                }
                2 => world.api.expire_watches(),
                3 => {
                    tampered.store(true, Ordering::SeqCst);
                    client.lock().unwrap().outage_since = Some(Instant::now());
                    sh("nft flush ruleset");
                }
                _ => {
                    tampered.store(true, Ordering::SeqCst);
                    client.lock().unwrap().outage_since = Some(Instant::now());
                    let s = usize::try_from(world.random() % services as u64).unwrap();
                    let ip = Ipv4Addr::from(0x0A60_0000u32 + 1 + u32::try_from(s).unwrap());
                    sh(&format!(
                        "nft delete element ip nodeproxy service-ips '{{ {ECHO_IP} . tcp . 80, {ip} . tcp . 80 }}' \
                         && nft delete element ip nodeproxy cluster-ips '{{ {ip} }}'"
                    ));
                }
            }
            if i != 1 {
                check = Some((what, Instant::now() + sync_period));
            }
            continue;
        }
        if now >= next_churn {
            world.churn();
            next_churn += churn_interval;
            if next_churn < now {
                next_churn = now + churn_interval;
            }
        }
        if now >= next_service {
            world.add_and_remove_service();
            next_service = now + Duration::from_secs(3);
        }
        if now >= next_echo {
            world.rotate_echo();
            next_echo = now + Duration::from_secs(5);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    if outage_until.is_some() {
        rt.block_on(world.api.come_back());
        check = Some(("API outage (10 s)", Instant::now() + sync_period));
    }
    // A disturbance still within its sync period gets the rest of it, as the others did.
    if let Some((what, at)) = check {
        std::thread::sleep(at.saturating_duration_since(Instant::now()));
        converge(
            what,
            &world,
            &settings,
            &tampered,
            &mut convergence,
            &mut failures,
        );
    }
    // The end state, after the last changes.
    converge(
        "end of run",
        &world,
        &settings,
        &tampered,
        &mut convergence,
        &mut failures,
    );
    sample(&mut samples);
    stop.store(true, Ordering::Relaxed);
    client_thread.join().unwrap();

    write_csv(&out_dir.join("samples.csv"), &samples);
    std::fs::write(out_dir.join("soak.svg"), plot(&samples, minutes)).unwrap();

    let c = client.lock().unwrap();
    println!(
        "client: {} connections, {} failed ({} while our rules were removed by hand, {} otherwise)",
        c.ok + c.failed,
        c.failed,
        c.excused,
        c.unexcused.len()
    );
    let worst = c.outages.iter().copied().fold(0.0, f64::max);
    println!(
        "client: after each removal of our rules by hand ({}), the first connection got through \
         again after at most {worst:.1} s (--sync-period {:.0} s)",
        c.outages.len(),
        sync_period.as_secs_f64()
    );
    if worst > sync_period.as_secs_f64() + CONVERGE_MARGIN.as_secs_f64() {
        failures.push(format!(
            "the echo Service was unreachable for {worst:.1} s after our rules were removed"
        ));
    }
    for f in c.unexcused.iter().take(10) {
        failures.push(format!(
            "client connection failed outside a tamper window: {f}"
        ));
    }
    for (what, times) in &convergence {
        let max = times.iter().copied().fold(0.0, f64::max);
        println!(
            "{what}: n={}, changes went on for {:.0} s, then the kernel matched after at most \
             {max:.1} s (limit {:.0} s)",
            times.len(),
            sync_period.as_secs_f64(),
            CONVERGE_MARGIN.as_secs_f64()
        );
    }
    let changes = world.changes;
    let (last_syncs, last_sum) = samples
        .last()
        .map(|s| (s.syncs, s.sync_seconds))
        .unwrap_or_default();
    println!(
        "objects changed: {changes}; syncs: {last_syncs:.0} (mean {:.1} ms); drift repairs: {:.0}",
        last_sum / last_syncs.max(1.0) * 1e3,
        samples.last().map(|s| s.repairs).unwrap_or_default()
    );
    // A removal by hand is counted as drift at most once per table it touched (a flush: both
    // families'), and nothing else is drift: more is a false alarm. It may be counted not at
    // all: when a change sync runs first, the kernel rejects its delta and the full sync that
    // follows repairs the table without having trusted its memory (that it was repaired is
    // what the convergence check shows).
    let repairs = samples.last().map(|s| s.repairs).unwrap_or_default();
    let tampers = c.outages.len() as f64 + f64::from(u8::from(c.outage_since.is_some()));
    println!("drift repairs counted: {repairs} for {tampers} removals of our rules by hand");
    if repairs > 2.0 * tampers {
        failures.push(format!(
            "{repairs} drift repairs counted for {tampers} removals of our rules by hand: \
             false alarms"
        ));
    }
    failures.extend(growth(&samples));
    drop(daemon);
    let text = daemon_log();
    let panics = text.lines().filter(|l| l.contains("panicked")).count();
    if panics > 0 {
        failures.push(format!("the daemon's log holds {panics} panic(s)"));
    }
    if std::env::var_os("NP_KEEP_LOG").is_some() {
        println!("daemon log kept: {}", log.display());
    } else {
        let _ = std::fs::remove_dir_all(&dir);
    }
    println!(
        "samples: {}, plot: {}",
        out_dir.join("samples.csv").display(),
        out_dir.join("soak.svg").display()
    );
    if failures.is_empty() {
        Ok(())
    } else {
        Err(failures.join("\n"))
    }
}

/// How long the kernel may take to match once the changes stop, one sync period after a
/// disturbance: the last change sync (`--min-sync-period`), or a verification sync (a full
/// read-back at 10k Services) if none has repaired the disturbance yet, plus the comparison's
/// own read-back.
const CONVERGE_MARGIN: Duration = Duration::from_secs(8);

/// Stops the changes and waits for the kernel to match the desired state.
fn converge(
    what: &'static str,
    world: &World,
    settings: &Settings,
    tampered: &AtomicBool,
    convergence: &mut BTreeMap<&'static str, Vec<f64>>,
    failures: &mut Vec<String>,
) {
    let t = Instant::now();
    let deadline = t + CONVERGE_MARGIN;
    loop {
        let Some(left) = divergence(world, settings) else {
            convergence
                .entry(what)
                .or_default()
                .push(t.elapsed().as_secs_f64());
            break;
        };
        if Instant::now() >= deadline {
            failures.push(format!(
                "not converged {:.0} s after {what}: {left}",
                t.elapsed().as_secs_f64()
            ));
            break;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    // Connections in flight when the rules came back may still fail; a short grace.
    std::thread::sleep(Duration::from_millis(300));
    tampered.store(false, Ordering::SeqCst);
}

fn write_csv(path: &Path, samples: &[Sample]) {
    let mut text = String::from(
        "seconds,rss_kib,fds,syncs,sync_seconds_total,drift_repairs,client_ok,client_failed\n",
    );
    for s in samples {
        text.push_str(&format!(
            "{:.1},{},{},{},{:.4},{},{},{}\n",
            s.t, s.rss_kib, s.fds, s.syncs, s.sync_seconds, s.repairs, s.client_ok, s.client_failed
        ));
    }
    std::fs::write(path, text).unwrap();
}

/// RSS and descriptors in the last quarter against the second (the first is warm-up).
fn growth(samples: &[Sample]) -> Vec<String> {
    let n = samples.len();
    if n < 8 {
        return vec![format!("only {n} samples: run longer")];
    }
    let q = n / 4;
    let (base, last) = (&samples[q..2 * q], &samples[n - q..]);
    let max_rss = |s: &[Sample]| s.iter().map(|s| s.rss_kib).max().unwrap_or(0);
    let max_fds = |s: &[Sample]| s.iter().map(|s| s.fds).max().unwrap_or(0);
    println!(
        "memory: VmRSS max {} KiB in the second quarter, {} KiB in the last; descriptors {} and {}",
        max_rss(base),
        max_rss(last),
        max_fds(base),
        max_fds(last)
    );
    let mut out = Vec::new();
    if max_rss(last) as f64 > max_rss(base) as f64 * 1.1 + 4096.0 {
        out.push(format!(
            "RSS grew: {} KiB -> {} KiB",
            max_rss(base),
            max_rss(last)
        ));
    }
    if max_fds(last) > max_fds(base) + 2 {
        out.push(format!(
            "open descriptors grew: {} -> {}",
            max_fds(base),
            max_fds(last)
        ));
    }
    out
}

/// Three stacked panels over time: VmRSS (MiB), mean sync time per 5 s interval (ms), drift
/// repairs (cumulative). Plain SVG: no plotting dependency for one figure.
fn plot(samples: &[Sample], minutes: f64) -> String {
    let (w, h, left, top) = (720.0, 150.0, 60.0, 30.0);
    let tmax = (minutes * 60.0).max(1.0);
    let sync_ms: Vec<(f64, f64)> = samples
        .windows(2)
        .map(|p| {
            let n = p[1].syncs - p[0].syncs;
            let v = if n > 0.0 {
                (p[1].sync_seconds - p[0].sync_seconds) / n * 1e3
            } else {
                0.0
            };
            (p[1].t, v)
        })
        .collect();
    let panels: [(&str, Vec<(f64, f64)>); 3] = [
        (
            "VmRSS (MiB)",
            samples
                .iter()
                .map(|s| (s.t, s.rss_kib as f64 / 1024.0))
                .collect(),
        ),
        ("mean sync time per 5 s (ms)", sync_ms),
        (
            "drift repairs (cumulative)",
            samples.iter().map(|s| (s.t, s.repairs)).collect(),
        ),
    ];
    let total_h = top + panels.len() as f64 * (h + top) + 20.0;
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{total_h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n",
        w + left + 20.0
    );
    for (i, (title, points)) in panels.iter().enumerate() {
        let y0 = top + i as f64 * (h + top);
        let vmax = points.iter().map(|p| p.1).fold(0.0, f64::max).max(1e-9) * 1.1;
        svg.push_str(&format!(
            "<text x=\"{left}\" y=\"{}\">{title}</text>\n\
             <rect x=\"{left}\" y=\"{y0}\" width=\"{w}\" height=\"{h}\" fill=\"none\" stroke=\"#999\"/>\n\
             <text x=\"{}\" y=\"{}\" text-anchor=\"end\">{:.1}</text>\n\
             <text x=\"{}\" y=\"{}\" text-anchor=\"end\">0</text>\n",
            y0 - 6.0,
            left - 4.0,
            y0 + 12.0,
            vmax / 1.1,
            left - 4.0,
            y0 + h
        ));
        let pts: Vec<String> = points
            .iter()
            .map(|(t, v)| {
                format!(
                    "{:.1},{:.1}",
                    left + t / tmax * w,
                    y0 + h - (v / vmax * h).min(h)
                )
            })
            .collect();
        svg.push_str(&format!(
            "<polyline fill=\"none\" stroke=\"#1f77b4\" stroke-width=\"1.5\" points=\"{}\"/>\n",
            pts.join(" ")
        ));
    }
    svg.push_str(&format!(
        "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{minutes} min</text>\n</svg>\n",
        left + w,
        total_h - 6.0
    ));
    svg
}

fn main() {
    // `cargo bench` passes `--bench`; a plain `cargo test --benches` run must not need root.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let minutes: f64 = env_or("NP_SOAK_MINUTES", 2.0);
    let h = std::thread::spawn(move || {
        if let Err(e) = nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET) {
            panic!("unshare(CLONE_NEWNET) failed ({e}); run as root");
        }
        run(minutes)
    });
    match h.join() {
        Ok(Ok(())) => println!("soak: passed"),
        Ok(Err(e)) => {
            eprintln!("soak: FAILED\n{e}");
            std::process::exit(1);
        }
        Err(p) => std::panic::resume_unwind(p),
    }
}
