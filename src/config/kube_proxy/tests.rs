//! kube-proxy's configuration file and flags: kubeadm's real default file, variants, and every
//! flag of kube-proxy's `--help`.

use std::ffi::OsString;
use std::path::Path;

use super::super::load::load_with;
use super::super::{ConfigError, Field, Loaded, Source, render_effective};
use super::INERT_FLAGS;

const PATH: &str = "/var/lib/kube-proxy/config.conf";

/// kube-proxy's ConfigMap as kubeadm writes it (`config.conf`), every field spelled out with its
/// zero value, which kube-proxy defaults.
const KUBEADM: &str = include_str!("../../../tests/data/kubeadm-kube-proxy.conf");

fn run(args: &[&str], env: &[(&str, &str)], file: &str) -> Result<Loaded, ConfigError> {
    let mut argv: Vec<OsString> = vec!["nodeproxy".into(), "--config".into(), PATH.into()];
    argv.extend(args.iter().map(OsString::from));
    let env: Vec<(String, String)> = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    load_with(
        argv,
        &|name| env.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()),
        &|path| {
            assert_eq!(path, Path::new(PATH));
            Ok(file.to_string())
        },
    )
}

fn ok(args: &[&str], env: &[(&str, &str)], file: &str) -> Loaded {
    run(args, env, file).unwrap_or_else(|error| panic!("load failed: {error}"))
}

/// `KUBEADM` with `from` replaced by `to` (which must occur exactly once).
fn kubeadm_with(edits: &[(&str, &str)]) -> String {
    let mut text = KUBEADM.to_string();
    for (from, to) in edits {
        assert_eq!(text.matches(from).count(), 1, "{from}");
        text = text.replacen(from, to, 1);
    }
    text
}

fn kube_source(field: &'static str) -> Source {
    Source::KubeProxyFile {
        path: PATH.into(),
        field,
    }
}

#[test]
fn kubeadms_default_file_gives_its_kubeconfig_and_cluster_cidr_and_defaults_otherwise() {
    let loaded = ok(&[], &[], KUBEADM);
    assert_eq!(loaded.warnings, Vec::<String>::new());
    let config = &loaded.config;
    assert_eq!(
        config.kubeconfig.as_deref(),
        Some(Path::new("/var/lib/kube-proxy/kubeconfig.conf"))
    );
    assert_eq!(config.cluster_cidr, vec!["10.244.0.0/16".parse().unwrap()]);
    assert_eq!(
        *loaded.provenance.of(Field::Kubeconfig),
        kube_source("clientConnection.kubeconfig")
    );
    // Every zero value is kube-proxy's "use the default": the defaults are nodeproxy's.
    let defaults = super::super::Config::default();
    assert_eq!(config.healthz_bind_address, defaults.healthz_bind_address);
    assert_eq!(config.metrics_bind_address, defaults.metrics_bind_address);
    assert_eq!(config.sync_period, defaults.sync_period);
    assert_eq!(config.min_sync_period, defaults.min_sync_period);
    assert_eq!(config.masquerade_bit, 14);
    assert_eq!(config.nodeport_addresses, defaults.nodeport_addresses);
    assert_eq!(config.hostname_override, None);
    assert_eq!(loaded.verbosity, 0);
    for field in [
        Field::SyncPeriod,
        Field::HealthzBindAddress,
        Field::MasqueradeBit,
    ] {
        assert_eq!(*loaded.provenance.of(field), Source::Default, "{field:?}");
    }
}

#[test]
fn a_dual_stack_nftables_file_maps_every_field_and_print_config_names_each_origin() {
    let text = kubeadm_with(&[
        (
            "clusterCIDR: 10.244.0.0/16",
            "clusterCIDR: 10.244.0.0/16,fd00:10:244::/56",
        ),
        (
            "  syncPeriod: 0s\nnodePortAddresses",
            "  syncPeriod: 45s\nnodePortAddresses",
        ),
        (
            "  minSyncPeriod: 0s\n  syncPeriod: 45s",
            "  minSyncPeriod: 2s\n  syncPeriod: 45s",
        ),
        (
            "  masqueradeAll: false\n  masqueradeBit: null\n  minSyncPeriod: 2s",
            "  masqueradeAll: true\n  masqueradeBit: 0\n  minSyncPeriod: 2s",
        ),
        (
            "nodePortAddresses: null",
            "nodePortAddresses:\n- primary\n- 192.0.2.0/24",
        ),
        ("hostnameOverride: \"\"", "hostnameOverride: Worker-1"),
        (
            "healthzBindAddress: \"\"",
            "healthzBindAddress: \"[::]:10256\"",
        ),
        (
            "metricsBindAddress: \"\"",
            "metricsBindAddress: 0.0.0.0:10249",
        ),
        (
            "detectLocalMode: \"\"",
            "detectLocalMode: InterfaceNamePrefix",
        ),
        ("  interfaceNamePrefix: \"\"", "  interfaceNamePrefix: veth"),
        ("  verbosity: 0", "  verbosity: 4\n  format: json"),
    ]);
    let loaded = ok(&[], &[], &text);
    assert_eq!(loaded.warnings, Vec::<String>::new());
    let c = &loaded.config;
    assert_eq!(c.cluster_cidr.len(), 2);
    assert_eq!(c.sync_period, std::time::Duration::from_secs(45));
    assert_eq!(c.min_sync_period, std::time::Duration::from_secs(2));
    // masqueradeBit is a pointer field upstream: an explicit 0 is bit 0, not the default.
    assert_eq!(c.masquerade_bit, 0);
    assert!(c.masquerade_all);
    assert!(c.nodeport_addresses.primary && c.nodeport_addresses.cidrs.len() == 1);
    assert_eq!(c.hostname_override.as_deref(), Some("worker-1"));
    assert_eq!(c.healthz_bind_address, Some("[::]:10256".parse().unwrap()));
    assert_eq!(
        c.metrics_bind_address,
        Some("0.0.0.0:10249".parse().unwrap())
    );
    assert_eq!(c.pod_interface_name_prefix.as_deref(), Some("veth"));
    assert_eq!(c.log_format, super::super::LogFormat::Json);
    assert_eq!(loaded.verbosity, 4);
    let printed = render_effective(&loaded.config, &loaded.provenance);
    for line in [
        "sync_period = \"45s\"  # kube-proxy config /var/lib/kube-proxy/config.conf: nftables.syncPeriod\n",
        "masquerade_bit = 0  # kube-proxy config /var/lib/kube-proxy/config.conf: nftables.masqueradeBit\n",
        "cluster_cidr = [\"10.244.0.0/16\", \"fd00:10:244::/56\"]  # kube-proxy config /var/lib/kube-proxy/config.conf: clusterCIDR\n",
        "pod_interface_name_prefix = \"veth\"  # kube-proxy config /var/lib/kube-proxy/config.conf: detectLocal.interfaceNamePrefix\n",
    ] {
        assert!(printed.contains(line), "{line}\n{printed}");
    }
}

#[test]
fn flags_and_the_environment_beat_the_kube_proxy_file() {
    // The field report: a kube-proxy config file made kube-proxy ignore --hostname-override.
    let text = kubeadm_with(&[
        ("hostnameOverride: \"\"", "hostnameOverride: from-file"),
        (
            "  syncPeriod: 0s\nnodePortAddresses",
            "  syncPeriod: 45s\nnodePortAddresses",
        ),
        ("  verbosity: 0", "  verbosity: 4"),
    ]);
    let loaded = ok(
        &["--hostname-override", "node-a", "--v", "1"],
        &[("NODEPROXY_SYNC_PERIOD", "10s")],
        &text,
    );
    assert_eq!(loaded.config.hostname_override.as_deref(), Some("node-a"));
    assert_eq!(*loaded.provenance.of(Field::HostnameOverride), Source::Flag);
    assert_eq!(
        loaded.config.sync_period,
        std::time::Duration::from_secs(10)
    );
    assert_eq!(
        *loaded.provenance.of(Field::SyncPeriod),
        Source::Env("NODEPROXY_SYNC_PERIOD".to_string())
    );
    assert_eq!(loaded.verbosity, 1);
    // kube-proxy's own flag spelling is a flag too.
    let loaded = ok(&["--iptables-sync-period=20s"], &[], &text);
    assert_eq!(
        loaded.config.sync_period,
        std::time::Duration::from_secs(20)
    );
    assert_eq!(
        *loaded.provenance.of(Field::SyncPeriod),
        Source::KubeProxyFlag("iptables-sync-period")
    );
    let printed = render_effective(&loaded.config, &loaded.provenance);
    assert!(
        printed.contains(
            "sync_period = \"20s\"  # flag --iptables-sync-period (kube-proxy's name for \
             --sync-period)\n"
        ),
        "{printed}"
    );
}

#[test]
fn ipvs_mode_leftovers_load_with_one_warning_each() {
    let text = kubeadm_with(&[
        ("mode: \"\"", "mode: ipvs"),
        ("  scheduler: \"\"", "  scheduler: rr"),
        ("  strictARP: false", "  strictARP: true"),
        (
            "  masqueradeAll: false\n  masqueradeBit: null\n  minSyncPeriod: 0s\n  syncPeriod: 0s\nipvs",
            "  masqueradeAll: true\n  masqueradeBit: null\n  minSyncPeriod: 0s\n  syncPeriod: 0s\nipvs",
        ),
        ("oomScoreAdj: null", "oomScoreAdj: -500"),
    ]);
    let loaded = ok(&[], &[], &text);
    let warnings = loaded.warnings.join("\n");
    assert_eq!(loaded.warnings.len(), 4, "{warnings}");
    for needle in [
        "mode: ipvs has no effect",
        "ipvs.scheduler has no effect in nodeproxy: nodeproxy has no IPVS mode",
        "ipvs.strictARP",
        "iptables.masqueradeAll has no effect in nodeproxy: an iptables-mode field; nodeproxy \
         reads nftables.*",
    ] {
        assert!(warnings.contains(needle), "{needle}\n{warnings}");
    }
    // The iptables field does not turn on nodeproxy's masquerade-all.
    assert!(!loaded.config.masquerade_all);
    assert_eq!(loaded.config.oom_score_adj, -500);
}

#[test]
fn a_file_written_by_kube_proxy_with_every_default_spelled_out_warns_about_nothing() {
    let text = kubeadm_with(&[
        ("  burst: 0", "  burst: 10"),
        (
            "  contentType: \"\"",
            "  contentType: application/vnd.kubernetes.protobuf",
        ),
        ("  qps: 0", "  qps: 5"),
        ("configSyncPeriod: 0s", "configSyncPeriod: 15m0s"),
        (
            "  masqueradeBit: null\n  minSyncPeriod: 0s\n  syncPeriod: 0s\nipvs",
            "  masqueradeBit: 14\n  minSyncPeriod: 1s\n  syncPeriod: 30s\nipvs",
        ),
        ("  flushFrequency: 0", "  flushFrequency: 5s"),
    ]);
    assert_eq!(ok(&[], &[], &text).warnings, Vec::<String>::new());
}

#[test]
fn unknown_fields_are_errors_naming_the_field_and_the_file() {
    let text = kubeadm_with(&[("portRange: \"\"", "portRange: \"\"\nudpIdleTimeout: 250ms")]);
    let error = run(&[], &[], &text).unwrap_err();
    assert_eq!(error.exit_code(), 2);
    let message = error.to_string();
    assert!(
        message.contains(PATH) && message.contains("unknown field `udpIdleTimeout`"),
        "{message}"
    );
    let text = kubeadm_with(&[(
        "  syncPeriod: 0s\nnodePortAddresses",
        "  syncPeriod: 0s\n  sync: 1s\nnodePortAddresses",
    )]);
    let message = run(&[], &[], &text).unwrap_err().to_string();
    assert!(message.contains("`nftables.sync`"), "{message}");
}

#[test]
fn an_invalid_value_names_the_setting_the_value_and_the_kube_proxy_field() {
    let text = kubeadm_with(&[(
        "  syncPeriod: 0s\nnodePortAddresses",
        "  syncPeriod: soon\nnodePortAddresses",
    )]);
    let message = run(&[], &[], &text).unwrap_err().to_string();
    assert!(
        message.starts_with(
            "invalid sync_period `\"soon\"` from kube-proxy config /var/lib/kube-proxy/config.conf: \
             nftables.syncPeriod:"
        ),
        "{message}"
    );
}

#[test]
fn json_is_read_and_other_api_versions_are_rejected() {
    let json = r#"{"apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
        "clusterCIDR": "10.244.0.0/16", "nftables": {"syncPeriod": "1m"}}"#;
    let loaded = ok(&[], &[], json);
    assert_eq!(
        loaded.config.sync_period,
        std::time::Duration::from_secs(60)
    );
    let other = "apiVersion: kubeproxy.config.k8s.io/v1beta1\nkind: KubeProxyConfiguration\n";
    let message = run(&[], &[], other).unwrap_err().to_string();
    assert!(
        message.contains("apiVersion: kubeproxy.config.k8s.io/v1alpha1"),
        "{message}"
    );
    // nodeproxy's TOML is still read as TOML.
    let loaded = ok(&[], &[], "sync_period = \"5s\"\n");
    assert_eq!(loaded.config.sync_period, std::time::Duration::from_secs(5));
}

#[test]
fn every_kube_proxy_flag_is_accepted_and_an_inert_one_warns_once_naming_itself() {
    for inert in INERT_FLAGS {
        let arg = if inert.boolean {
            format!("--{}", inert.flag)
        } else {
            format!("--{}=-7", inert.flag)
        };
        let loaded = ok(&[&arg], &[], "");
        assert_eq!(loaded.warnings.len(), 1, "{arg}: {:?}", loaded.warnings);
        assert!(
            loaded.warnings[0].starts_with(&format!("kube-proxy flag --{}=", inert.flag)),
            "{:?}",
            loaded.warnings
        );
        // The value may also be the next word.
        if !inert.boolean {
            let loaded = ok(&[&format!("--{}", inert.flag), "x", "--once"], &[], "");
            assert_eq!(loaded.warnings.len(), 1, "{arg}");
        }
    }
    // Asking for what nodeproxy does is not warned about.
    assert!(
        ok(&["--proxy-mode", "nftables"], &[], "")
            .warnings
            .is_empty()
    );
    // kube-proxy's spellings of settings set them.
    let loaded = ok(
        &[
            "--iptables-min-sync-period",
            "3s",
            "--iptables-masquerade-bit",
            "5",
            "--logging-format",
            "json",
        ],
        &[],
        "",
    );
    assert_eq!(
        loaded.config.min_sync_period,
        std::time::Duration::from_secs(3)
    );
    assert_eq!(loaded.config.masquerade_bit, 5);
    assert_eq!(loaded.config.log_format, super::super::LogFormat::Json);
    // A flag kube-proxy does not have is still a usage error.
    let error = run(&["--iptables-sync-perod", "1s"], &[], "").unwrap_err();
    assert_eq!(error.exit_code(), 2);
}

#[test]
fn conntrack_fields_map_and_an_explicit_zero_pointer_is_a_value() {
    let text = kubeadm_with(&[
        ("  maxPerCore: null", "  maxPerCore: 0"),
        (
            "  tcpEstablishedTimeout: null",
            "  tcpEstablishedTimeout: 12h0m0s",
        ),
        ("  tcpBeLiberal: false", "  tcpBeLiberal: true"),
        (
            "  udpTimeout: 0s\ndetectLocal",
            "  udpTimeout: 30s\ndetectLocal",
        ),
    ]);
    let loaded = ok(&[], &[], &text);
    assert_eq!(loaded.warnings, Vec::<String>::new());
    let conntrack = loaded.config.conntrack();
    assert_eq!(
        conntrack.max_per_core, 0,
        "maxPerCore: 0 leaves nf_conntrack_max alone"
    );
    assert_eq!(conntrack.min, 131_072);
    assert_eq!(
        conntrack.tcp_established_timeout,
        std::time::Duration::from_secs(12 * 3600)
    );
    assert!(conntrack.tcp_be_liberal);
    assert_eq!(conntrack.udp_timeout, std::time::Duration::from_secs(30));
    assert_eq!(
        *loaded.provenance.of(Field::ConntrackMaxPerCore),
        kube_source("conntrack.maxPerCore")
    );
    // kubeadm's null keeps kube-proxy's defaults.
    let conntrack = ok(&[], &[], KUBEADM).config.conntrack();
    assert_eq!(conntrack, nodeproxy_default_conntrack());
}

fn nodeproxy_default_conntrack() -> crate::node_setup::Conntrack {
    crate::node_setup::Conntrack::default()
}

#[test]
fn every_flag_of_kube_proxys_help_is_a_flag_of_nodeproxy() {
    let command = super::super::command();
    let longs: Vec<String> = command
        .get_arguments()
        .flat_map(|arg| {
            arg.get_long()
                .into_iter()
                .chain(arg.get_all_aliases().unwrap_or_default())
                .map(str::to_string)
        })
        .chain(["version".to_string()])
        .collect();
    for flag in super::KUBE_PROXY_FLAGS {
        assert!(longs.iter().any(|l| l == flag), "--{flag} is not accepted");
        assert!(!super::flag_use(flag).contains("not accepted"), "--{flag}");
    }
    let tables = super::migration_tables();
    assert!(!tables.contains("not accepted"), "{tables}");
}

#[test]
fn kube_proxys_v_with_a_level_is_its_verbosity_and_nodeproxys_counted_v_still_counts() {
    for args in [&["-v=3"][..], &["-v", "3"], &["--v=3"], &["--v", "3"]] {
        assert_eq!(ok(args, &[], "").verbosity, 3, "{args:?}");
    }
    assert_eq!(ok(&["-vv"], &[], "").verbosity, 2);
    assert_eq!(ok(&["-v", "--once"], &[], "").verbosity, 1);
}

#[test]
fn unknown_field_names_are_escaped_and_at_most_ten_are_named() {
    let mut text = String::from(
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n\"bad\\nkey\": 1\n",
    );
    for i in 0..50 {
        text.push_str(&format!("junk{i}: 1\n"));
    }
    let message = run(&[], &[], &text).unwrap_err().to_string();
    assert!(message.contains("`bad\\nkey`"), "{message}");
    assert!(!message.contains('\n'), "{message}");
    assert_eq!(message.matches("`junk").count(), 9, "{message}");
}
