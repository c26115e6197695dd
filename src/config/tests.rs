//! The configuration: precedence, provenance, every value parser and the generated text.
use super::duration::{format_duration, parse_duration};
use super::load::{edit_distance, load_with};
use super::settings::render_value;
use super::*;
use std::collections::HashMap;
use std::path::Path;

const FILE: &str = "/etc/nodeproxy/test.toml";

/// Runs `load` with an in-memory environment and an in-memory config file at `FILE`
/// (named by `--config` only when `file` is given).
fn run(args: &[&str], env: &[(&str, &str)], file: Option<&str>) -> Result<Loaded, ConfigError> {
    let env: HashMap<String, String> = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let mut argv: Vec<OsString> = vec!["nodeproxy".into()];
    if file.is_some() {
        argv.push("--config".into());
        argv.push(FILE.into());
    }
    argv.extend(args.iter().map(OsString::from));
    let contents = file.map(str::to_string);
    load_with(argv, &|name| env.get(name).cloned(), &|path| {
        assert_eq!(path, Path::new(FILE));
        contents
            .clone()
            .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::NotFound))
    })
}

fn ok(args: &[&str], env: &[(&str, &str)], file: Option<&str>) -> Loaded {
    match run(args, env, file) {
        Ok(loaded) => loaded,
        Err(error) => panic!("load failed: {error}"),
    }
}

fn err(args: &[&str], env: &[(&str, &str)], file: Option<&str>) -> String {
    match run(args, env, file) {
        Ok(loaded) => panic!("load unexpectedly succeeded: {loaded:?}"),
        Err(error) => error.to_string(),
    }
}

/// Per field: a flag, an env value and a file line, and the TOML rendering each yields.
struct Case {
    field: Field,
    flag: &'static [&'static str],
    flag_value: &'static str,
    env: &'static str,
    env_value: &'static str,
    file: &'static str,
    file_value: &'static str,
    default_value: &'static str,
}

const CASES: &[Case] = &[
    Case {
        field: Field::HostnameOverride,
        flag: &["--hostname-override", "Flag-Node"],
        flag_value: "\"flag-node\"",
        env: "env-node",
        env_value: "\"env-node\"",
        file: "hostname_override = \"file-node\"",
        file_value: "\"file-node\"",
        default_value: "\"\"",
    },
    Case {
        field: Field::Kubeconfig,
        flag: &["--kubeconfig", "/flag/kubeconfig"],
        flag_value: "\"/flag/kubeconfig\"",
        env: "/env/kubeconfig",
        env_value: "\"/env/kubeconfig\"",
        file: "kubeconfig = \"/file/kubeconfig\"",
        file_value: "\"/file/kubeconfig\"",
        default_value: "\"\"",
    },
    Case {
        field: Field::Master,
        flag: &["--master", "https://flag.example:6443"],
        flag_value: "\"https://flag.example:6443\"",
        env: "http://192.0.2.1:8080",
        env_value: "\"http://192.0.2.1:8080\"",
        file: "master = \"https://[2001:db8::1]:6443/\"",
        file_value: "\"https://[2001:db8::1]:6443/\"",
        default_value: "\"\"",
    },
    Case {
        field: Field::KubeApiQps,
        flag: &["--kube-api-qps", "20"],
        flag_value: "20.0",
        env: "0.5",
        env_value: "0.5",
        file: "kube_api_qps = 7",
        file_value: "7.0",
        default_value: "5.0",
    },
    Case {
        field: Field::KubeApiBurst,
        flag: &["--kube-api-burst", "40"],
        flag_value: "40",
        env: "1",
        env_value: "1",
        file: "kube_api_burst = 3",
        file_value: "3",
        default_value: "10",
    },
    Case {
        field: Field::ClusterCidr,
        flag: &["--cluster-cidr", "10.1.0.0/16"],
        flag_value: "[\"10.1.0.0/16\"]",
        env: "10.2.0.0/16,fd00:2::/56",
        env_value: "[\"10.2.0.0/16\", \"fd00:2::/56\"]",
        file: "cluster_cidr = [\"10.3.0.0/16\"]",
        file_value: "[\"10.3.0.0/16\"]",
        default_value: "[]",
    },
    Case {
        field: Field::ServiceCidr,
        flag: &["--service-cidr", "10.96.0.0/12"],
        flag_value: "[\"10.96.0.0/12\"]",
        env: "10.97.0.0/16,fd00:10:96::/112",
        env_value: "[\"10.97.0.0/16\", \"fd00:10:96::/112\"]",
        file: "service_cidr = [\"fd00:10:97::/112\"]",
        file_value: "[\"fd00:10:97::/112\"]",
        default_value: "[]",
    },
    Case {
        field: Field::DetectLocalMode,
        flag: &[
            "--detect-local-mode",
            "bridgeinterface",
            "--pod-bridge-interface",
            "cni0",
        ],
        flag_value: "\"BridgeInterface\"",
        env: "NodeCIDR",
        env_value: "\"NodeCIDR\"",
        file: "detect_local_mode = \"ClusterCIDR\"\ncluster_cidr = \"10.244.0.0/16\"",
        file_value: "\"ClusterCIDR\"",
        default_value: "\"NodeCIDR\"",
    },
    Case {
        field: Field::PodBridgeInterface,
        flag: &["--pod-bridge-interface", "br-flag"],
        flag_value: "\"br-flag\"",
        env: "br-env",
        env_value: "\"br-env\"",
        file: "pod_bridge_interface = \"br-file\"",
        file_value: "\"br-file\"",
        default_value: "\"\"",
    },
    Case {
        field: Field::PodInterfaceNamePrefix,
        flag: &["--pod-interface-name-prefix", "vethf"],
        flag_value: "\"vethf\"",
        env: "vethe",
        env_value: "\"vethe\"",
        file: "pod_interface_name_prefix = \"cali\"",
        file_value: "\"cali\"",
        default_value: "\"\"",
    },
    Case {
        field: Field::MasqueradeAll,
        flag: &["--masquerade-all=false"],
        flag_value: "false",
        env: "true",
        env_value: "true",
        file: "masquerade_all = false",
        file_value: "false",
        default_value: "false",
    },
    Case {
        field: Field::MasqueradeBit,
        flag: &["--masquerade-bit", "1"],
        flag_value: "1",
        env: "2",
        env_value: "2",
        file: "masquerade_bit = 3",
        file_value: "3",
        default_value: "14",
    },
    Case {
        field: Field::NodePortAddresses,
        flag: &["--nodeport-addresses", "primary,192.0.2.0/24"],
        flag_value: "\"primary,192.0.2.0/24\"",
        env: "all",
        env_value: "\"all\"",
        file: "nodeport_addresses = [\"10.0.0.0/8\", \"::/0\"]",
        file_value: "\"10.0.0.0/8,::/0\"",
        default_value: "\"primary\"",
    },
    Case {
        field: Field::HealthzBindAddress,
        flag: &["--healthz-bind-address", "127.0.0.1:1"],
        flag_value: "\"127.0.0.1:1\"",
        env: "[::]:10256",
        env_value: "\"[::]:10256\"",
        file: "healthz_bind_address = \"\"",
        file_value: "\"\"",
        default_value: "\"0.0.0.0:10256\"",
    },
    Case {
        field: Field::MetricsBindAddress,
        flag: &["--metrics-bind-address", "0.0.0.0:9100"],
        flag_value: "\"0.0.0.0:9100\"",
        env: "[::1]:10249",
        env_value: "\"[::1]:10249\"",
        file: "metrics_bind_address = \"\"",
        file_value: "\"\"",
        default_value: "\"127.0.0.1:10249\"",
    },
    Case {
        field: Field::BindAddressHardFail,
        flag: &["--bind-address-hard-fail"],
        flag_value: "true",
        env: "1",
        env_value: "true",
        file: "bind_address_hard_fail = true",
        file_value: "true",
        default_value: "false",
    },
    Case {
        field: Field::MinSyncPeriod,
        flag: &["--min-sync-period", "2s"],
        flag_value: "\"2s\"",
        env: "500ms",
        env_value: "\"500ms\"",
        file: "min_sync_period = 0",
        file_value: "\"0s\"",
        default_value: "\"1s\"",
    },
    Case {
        field: Field::SyncPeriod,
        flag: &["--sync-period", "1m"],
        flag_value: "\"1m\"",
        env: "1h30m",
        env_value: "\"1h30m\"",
        file: "sync_period = \"1.5s\"",
        file_value: "\"1.5s\"",
        default_value: "\"30s\"",
    },
    Case {
        field: Field::LockFile,
        flag: &["--lock-file", "/flag.lock"],
        flag_value: "\"/flag.lock\"",
        env: "/env.lock",
        env_value: "\"/env.lock\"",
        file: "lock_file = \"/file.lock\"",
        file_value: "\"/file.lock\"",
        default_value: "\"/run/nodeproxy/nodeproxy.lock\"",
    },
    Case {
        field: Field::ConntrackMaxPerCore,
        flag: &["--conntrack-max-per-core", "0"],
        flag_value: "0",
        env: "65536",
        env_value: "65536",
        file: "conntrack_max_per_core = 1",
        file_value: "1",
        default_value: "32768",
    },
    Case {
        field: Field::ConntrackMin,
        flag: &["--conntrack-min", "1"],
        flag_value: "1",
        env: "2",
        env_value: "2",
        file: "conntrack_min = 3",
        file_value: "3",
        default_value: "131072",
    },
    Case {
        field: Field::ConntrackTcpTimeoutEstablished,
        flag: &["--conntrack-tcp-timeout-established", "12h"],
        flag_value: "\"12h\"",
        env: "0",
        env_value: "\"0s\"",
        file: "conntrack_tcp_timeout_established = \"90m\"",
        file_value: "\"1h30m\"",
        default_value: "\"24h\"",
    },
    Case {
        field: Field::ConntrackTcpTimeoutCloseWait,
        flag: &["--conntrack-tcp-timeout-close-wait", "60s"],
        flag_value: "\"1m\"",
        env: "2m",
        env_value: "\"2m\"",
        file: "conntrack_tcp_timeout_close_wait = \"3m\"",
        file_value: "\"3m\"",
        default_value: "\"1h\"",
    },
    Case {
        field: Field::ConntrackTcpBeLiberal,
        flag: &["--conntrack-tcp-be-liberal"],
        flag_value: "true",
        env: "false",
        env_value: "false",
        file: "conntrack_tcp_be_liberal = true",
        file_value: "true",
        default_value: "false",
    },
    Case {
        field: Field::ConntrackUdpTimeout,
        flag: &["--conntrack-udp-timeout", "30s"],
        flag_value: "\"30s\"",
        env: "45s",
        env_value: "\"45s\"",
        file: "conntrack_udp_timeout = \"1m\"",
        file_value: "\"1m\"",
        default_value: "\"0s\"",
    },
    Case {
        field: Field::ConntrackUdpTimeoutStream,
        flag: &["--conntrack-udp-timeout-stream", "2m"],
        flag_value: "\"2m\"",
        env: "3m",
        env_value: "\"3m\"",
        file: "conntrack_udp_timeout_stream = \"4m\"",
        file_value: "\"4m\"",
        default_value: "\"0s\"",
    },
    Case {
        field: Field::OomScoreAdj,
        flag: &["--oom-score-adj", "-1000"],
        flag_value: "-1000",
        env: "500",
        env_value: "500",
        file: "oom_score_adj = 0",
        file_value: "0",
        default_value: "-999",
    },
    Case {
        field: Field::CleanupKubeProxy,
        flag: &["--cleanup-kube-proxy"],
        flag_value: "true",
        env: "false",
        env_value: "false",
        file: "cleanup_kube_proxy = true",
        file_value: "true",
        default_value: "false",
    },
    Case {
        field: Field::FromFile,
        flag: &["--from-file", "/flag/a.yaml", "--from-file", "/flag/b.yaml"],
        flag_value: "[\"/flag/a.yaml\", \"/flag/b.yaml\"]",
        env: "/env/a.yaml,/env/b.yaml",
        env_value: "[\"/env/a.yaml\", \"/env/b.yaml\"]",
        file: "from_file = [\"/file/a.yaml\"]",
        file_value: "[\"/file/a.yaml\"]",
        default_value: "[]",
    },
    Case {
        field: Field::LogFormat,
        flag: &["--log-format", "json"],
        flag_value: "\"json\"",
        env: "text",
        env_value: "\"text\"",
        file: "log_format = \"json\"",
        file_value: "\"json\"",
        default_value: "\"text\"",
    },
    Case {
        field: Field::TableOwnership,
        flag: &["--table-ownership", "off"],
        flag_value: "\"off\"",
        env: "auto",
        env_value: "\"auto\"",
        file: "table_ownership = \"off\"",
        file_value: "\"off\"",
        default_value: "\"auto\"",
    },
];

#[test]
fn every_field_has_a_precedence_case() {
    let covered: Vec<Field> = CASES.iter().map(|case| case.field).collect();
    assert_eq!(covered, Field::ALL);
}

#[test]
fn a_flag_beats_env_file_and_default_for_every_field() {
    for case in CASES {
        let var = case.field.env_var();
        let loaded = ok(case.flag, &[(&var, case.env)], Some(case.file));
        assert_eq!(
            render_value(&loaded.config, case.field),
            case.flag_value,
            "{:?}",
            case.field
        );
        assert_eq!(loaded.provenance.of(case.field), &Source::Flag);
    }
}

#[test]
fn env_beats_file_and_default_for_every_field() {
    for case in CASES {
        let var = case.field.env_var();
        let loaded = ok(&[], &[(&var, case.env)], Some(case.file));
        assert_eq!(
            render_value(&loaded.config, case.field),
            case.env_value,
            "{:?}",
            case.field
        );
        assert_eq!(
            loaded.provenance.of(case.field),
            &Source::Env(var.to_string())
        );
    }
}

#[test]
fn file_beats_default_for_every_field() {
    for case in CASES {
        let loaded = ok(&[], &[], Some(case.file));
        assert_eq!(
            render_value(&loaded.config, case.field),
            case.file_value,
            "{:?}",
            case.field
        );
        assert_eq!(
            loaded.provenance.of(case.field),
            &Source::File(PathBuf::from(FILE))
        );
    }
}

#[test]
fn nothing_given_means_the_default_for_every_field() {
    let loaded = ok(&[], &[], None);
    assert_eq!(loaded.config, Config::default());
    assert_eq!(loaded.provenance, Provenance::default());
    assert_eq!(loaded.mode, Mode::Run);
    for case in CASES {
        assert_eq!(render_value(&loaded.config, case.field), case.default_value);
    }
}

#[test]
fn the_packaged_default_file_loads_as_is_and_uncommented_to_the_defaults() {
    let text = render_default_file();
    assert_eq!(ok(&[], &[], Some(&text)).config, Config::default());
    // Every setting is there, commented out, under its help text.
    let uncommented: String = text
        .lines()
        .map(|line| match line.strip_prefix('#') {
            Some(rest)
                if Field::ALL
                    .iter()
                    .any(|f| rest.starts_with(&format!("{} = ", f.key()))) =>
            {
                rest
            }
            _ => line,
        })
        .map(|line| format!("{line}\n"))
        .collect();
    for field in Field::ALL {
        assert!(
            uncommented.contains(&format!("\n{} = ", field.key())),
            "{} missing:\n{text}",
            field.key()
        );
    }
    let loaded = ok(&[], &[], Some(&uncommented));
    assert_eq!(loaded.config, Config::default());
    assert!(
        text.contains("# The packet mark bit"),
        "help text missing:\n{text}"
    );
}

#[test]
fn hostname_override_in_a_config_file_does_not_override_the_flag() {
    let file = "hostname_override = \"localhost\"\n";
    let loaded = ok(&["--hostname-override", "worker-7"], &[], Some(file));
    assert_eq!(loaded.config.hostname_override.as_deref(), Some("worker-7"));
    assert_eq!(*loaded.provenance.of(Field::HostnameOverride), Source::Flag);
    let loaded = ok(
        &[],
        &[("NODEPROXY_HOSTNAME_OVERRIDE", "worker-8")],
        Some(file),
    );
    assert_eq!(loaded.config.hostname_override.as_deref(), Some("worker-8"));
}

#[test]
fn an_empty_environment_variable_counts_as_unset() {
    let loaded = ok(
        &[],
        &[("NODEPROXY_HOSTNAME_OVERRIDE", "")],
        Some("hostname_override = \"from-file\""),
    );
    assert_eq!(
        loaded.config.hostname_override.as_deref(),
        Some("from-file")
    );
}

#[test]
fn hostname_override_is_trimmed_and_lowercased_and_empty_means_unset() {
    let loaded = ok(
        &["--hostname-override", "  Worker-7.Example.COM "],
        &[],
        None,
    );
    assert_eq!(
        loaded.config.hostname_override.as_deref(),
        Some("worker-7.example.com")
    );
    // An explicit empty flag still wins over the file: it unsets the override.
    let loaded = ok(
        &["--hostname-override="],
        &[],
        Some("hostname_override = \"x\""),
    );
    assert_eq!(loaded.config.hostname_override, None);
    assert_eq!(*loaded.provenance.of(Field::HostnameOverride), Source::Flag);
}

#[test]
fn a_hostname_override_that_is_not_a_dns_name_is_rejected() {
    let message = err(&["--hostname-override", "node 1"], &[], None);
    assert!(message.contains("hostname_override"), "{message}");
    assert!(message.contains("node 1"), "{message}");
    assert!(message.contains("DNS subdomain"), "{message}");
}

#[test]
fn node_name_lowercases_the_override() {
    let config = Config {
        hostname_override: Some("Worker-7".to_string()),
        ..Config::default()
    };
    assert_eq!(config.node_name().unwrap(), "worker-7");
}

#[test]
fn node_name_lowercases_the_host_name_and_is_never_empty() {
    let name = node_name_from(None, || Ok(OsString::from("Host-A\n"))).unwrap();
    assert_eq!(name, "host-a");
    let name = node_name_from(Some("  "), || Ok(OsString::from("HOST"))).unwrap();
    assert_eq!(name, "host");
    assert!(node_name_from(None, || Ok(OsString::new())).is_err());
    assert!(node_name_from(None, || Err("EPERM".to_string())).is_err());
    let real = Config::default().node_name().unwrap();
    assert!(!real.is_empty());
    assert_eq!(real, real.to_lowercase());
}

#[test]
fn an_unknown_config_key_is_an_error_naming_the_key_and_listing_valid_keys() {
    let message = err(&[], &[], Some("hostname = \"a\"\nmasquerade_bit = 14\n"));
    assert!(message.contains("`hostname`"), "{message}");
    assert!(message.contains(FILE), "{message}");
    for field in Field::ALL {
        assert!(message.contains(field.key()), "{message}");
    }
}

#[test]
fn an_unknown_key_spelled_like_a_flag_or_kube_proxy_yaml_gets_a_hint() {
    let message = err(&[], &[], Some("hostname-override = \"a\""));
    assert!(
        message.contains("did you mean `hostname_override`"),
        "{message}"
    );
    let message = err(&[], &[], Some("nodePortAddresses = \"primary\""));
    assert!(
        message.contains("did you mean `nodeport_addresses`"),
        "{message}"
    );
}

#[test]
fn an_unknown_key_is_an_error_even_when_a_flag_sets_every_field() {
    let message = err(
        &["--hostname-override", "a"],
        &[],
        Some("hostname_overide = \"b\""),
    );
    assert!(message.contains("hostname_overide"), "{message}");
}

#[test]
fn an_invalid_flag_value_names_key_value_and_flag() {
    let message = err(&["--masquerade-bit", "32"], &[], None);
    assert!(message.contains("masquerade_bit"), "{message}");
    assert!(message.contains("`32`"), "{message}");
    assert!(message.contains("flag --masquerade-bit"), "{message}");
    assert!(message.contains("0 to 31"), "{message}");
}

#[test]
fn an_invalid_env_value_names_key_value_and_variable() {
    let message = err(&[], &[("NODEPROXY_MASQUERADE_ALL", "yes")], None);
    assert!(message.contains("masquerade_all"), "{message}");
    assert!(message.contains("`yes`"), "{message}");
    assert!(
        message.contains("env NODEPROXY_MASQUERADE_ALL"),
        "{message}"
    );
    assert!(message.contains("true or false"), "{message}");
}

#[test]
fn an_invalid_file_value_names_key_value_and_file() {
    let message = err(&[], &[], Some("cluster_cidr = \"10.0.0.0/33\""));
    assert!(message.contains("cluster_cidr"), "{message}");
    assert!(message.contains("10.0.0.0/33"), "{message}");
    assert!(message.contains(&format!("file {FILE}")), "{message}");
    assert!(message.contains("not a CIDR"), "{message}");
    let message = err(&[], &[], Some("masquerade_bit = \"14\""));
    assert!(message.contains("masquerade_bit `\"14\"`"), "{message}");
    let message = err(&[], &[], Some("log_format = \"yaml\""));
    assert!(message.contains("`text` or `json`"), "{message}");
}

#[test]
fn an_invalid_value_in_a_lower_source_is_ignored_when_a_higher_one_wins() {
    // Only the effective value is validated; a shadowed one cannot affect the node.
    let loaded = ok(
        &["--masquerade-bit", "5"],
        &[("NODEPROXY_MASQUERADE_BIT", "99")],
        Some("masquerade_bit = 77"),
    );
    assert_eq!(loaded.config.masquerade_bit, 5);
}

#[test]
fn a_dual_stack_cluster_cidr_pair_is_accepted() {
    let loaded = ok(
        &["--cluster-cidr", "10.244.0.0/16, fd00:10:244::/56"],
        &[],
        None,
    );
    let expected: Vec<IpNet> = vec![
        "10.244.0.0/16".parse().unwrap(),
        "fd00:10:244::/56".parse().unwrap(),
    ];
    assert_eq!(loaded.config.cluster_cidr, expected);
    let loaded = ok(
        &[],
        &[],
        Some("cluster_cidr = \"10.244.0.0/16,fd00:10:244::/56\""),
    );
    assert_eq!(loaded.config.cluster_cidr, expected);
}

#[test]
fn two_cluster_cidrs_of_the_same_family_are_rejected() {
    let message = err(
        &["--cluster-cidr", "10.244.0.0/16,10.245.0.0/16"],
        &[],
        None,
    );
    assert!(message.contains("two IPv4 CIDRs"), "{message}");
    assert!(message.contains("flag --cluster-cidr"), "{message}");
    let message = err(
        &[],
        &[("NODEPROXY_CLUSTER_CIDR", "fd00::/56,fd01::/56")],
        None,
    );
    assert!(message.contains("two IPv6 CIDRs"), "{message}");
}

#[test]
fn a_cluster_cidr_with_host_bits_or_without_prefix_is_rejected_with_a_suggestion() {
    let message = err(&["--cluster-cidr", "10.244.1.5/16"], &[], None);
    assert!(message.contains("did you mean 10.244.0.0/16"), "{message}");
    let message = err(&["--cluster-cidr", "10.244.1.5"], &[], None);
    assert!(message.contains("an address, not a CIDR"), "{message}");
}

#[test]
fn masquerade_bit_32_is_rejected_and_31_accepted() {
    assert!(err(&["--masquerade-bit", "32"], &[], None).contains("0 to 31"));
    assert!(err(&[], &[], Some("masquerade_bit = 32")).contains("0 to 31"));
    assert!(err(&[], &[], Some("masquerade_bit = -1")).contains("0 to 31"));
    let loaded = ok(&["--masquerade-bit", "31"], &[], None);
    assert_eq!(loaded.config.masquerade_bit, 31);
    assert_eq!(loaded.config.masquerade_mark(), 1 << 31);
}

#[test]
fn field_names_follow_one_scheme() {
    for field in Field::ALL {
        assert_eq!(field.flag(), format!("--{}", field.key().replace('_', "-")));
        assert_eq!(
            field.env_var(),
            format!("NODEPROXY_{}", field.key().to_uppercase())
        );
    }
}

#[test]
fn detect_local_mode_defaults_to_cluster_cidr_when_a_cluster_cidr_is_set_else_node_cidr() {
    assert_eq!(
        Config::default().detect_local_mode(),
        DetectLocalMode::NodeCidr
    );
    let loaded = ok(&[], &[], None);
    assert_eq!(loaded.config.detect_local_mode(), DetectLocalMode::NodeCidr);
    assert_eq!(
        *loaded.provenance.of(Field::DetectLocalMode),
        Source::Default
    );
    // The cluster CIDR may come from any source; the default follows the merged value.
    for loaded in [
        ok(&["--cluster-cidr", "10.244.0.0/16"], &[], None),
        ok(&[], &[("NODEPROXY_CLUSTER_CIDR", "fd00:10:244::/56")], None),
        ok(&[], &[], Some("cluster_cidr = \"10.244.0.0/16\"")),
    ] {
        assert_eq!(
            loaded.config.detect_local_mode(),
            DetectLocalMode::ClusterCidr
        );
        assert_eq!(
            *loaded.provenance.of(Field::DetectLocalMode),
            Source::Default
        );
    }
    // An explicit mode wins over the derived default.
    let loaded = ok(
        &[
            "--cluster-cidr",
            "10.244.0.0/16",
            "--detect-local-mode",
            "NodeCIDR",
        ],
        &[],
        None,
    );
    assert_eq!(loaded.config.detect_local_mode(), DetectLocalMode::NodeCidr);
    assert_eq!(*loaded.provenance.of(Field::DetectLocalMode), Source::Flag);
}

#[test]
fn detect_local_mode_is_case_insensitive_and_an_unknown_mode_lists_the_valid_ones() {
    let loaded = ok(
        &[],
        &[
            ("NODEPROXY_DETECT_LOCAL_MODE", "interfacenameprefix"),
            ("NODEPROXY_POD_INTERFACE_NAME_PREFIX", "veth"),
        ],
        None,
    );
    assert_eq!(
        loaded.config.detect_local_mode(),
        DetectLocalMode::InterfaceNamePrefix
    );
    let message = err(&["--detect-local-mode", "PodCIDR"], &[], None);
    assert!(message.contains("detect_local_mode `PodCIDR`"), "{message}");
    assert!(message.contains("flag --detect-local-mode"), "{message}");
    assert!(
        message.contains("ClusterCIDR, NodeCIDR, BridgeInterface, InterfaceNamePrefix"),
        "{message}"
    );
}

#[test]
fn bridge_interface_mode_without_a_bridge_is_rejected_naming_both_fields() {
    let message = err(&[], &[], Some("detect_local_mode = \"BridgeInterface\""));
    assert!(message.contains("detect_local_mode"), "{message}");
    assert!(message.contains(&format!("file {FILE}")), "{message}");
    assert!(
        message.contains("requires pod_bridge_interface (--pod-bridge-interface)"),
        "{message}"
    );
    let loaded = ok(
        &["--detect-local-mode=BridgeInterface"],
        &[("NODEPROXY_POD_BRIDGE_INTERFACE", "cni0")],
        None,
    );
    assert_eq!(loaded.config.pod_bridge_interface.as_deref(), Some("cni0"));
}

#[test]
fn interface_name_prefix_mode_without_a_prefix_is_rejected_naming_both_fields() {
    let message = err(&["--detect-local-mode", "InterfaceNamePrefix"], &[], None);
    assert!(message.contains("detect_local_mode"), "{message}");
    assert!(
        message.contains("requires pod_interface_name_prefix (--pod-interface-name-prefix)"),
        "{message}"
    );
    // A prefix given without the mode is allowed (and unused).
    let loaded = ok(&["--pod-interface-name-prefix", "veth"], &[], None);
    assert_eq!(loaded.config.detect_local_mode(), DetectLocalMode::NodeCidr);
}

#[test]
fn an_explicit_cluster_cidr_mode_without_a_cluster_cidr_is_rejected_naming_both_fields() {
    let message = err(&[], &[("NODEPROXY_DETECT_LOCAL_MODE", "ClusterCIDR")], None);
    assert!(
        message.contains("detect_local_mode `ClusterCIDR`"),
        "{message}"
    );
    assert!(
        message.contains("env NODEPROXY_DETECT_LOCAL_MODE"),
        "{message}"
    );
    assert!(
        message.contains("requires cluster_cidr (--cluster-cidr)"),
        "{message}"
    );
    let loaded = ok(
        &["--detect-local-mode", "clustercidr"],
        &[("NODEPROXY_CLUSTER_CIDR", "10.244.0.0/16")],
        None,
    );
    assert_eq!(
        loaded.config.detect_local_mode(),
        DetectLocalMode::ClusterCidr
    );
}

#[test]
fn pod_interface_names_must_be_valid_linux_interface_names() {
    for bad in ["a-name-of-16-byt", "a/b", "eth0:1", "br 0", ".", ".."] {
        let message = err(&["--pod-bridge-interface", bad], &[], None);
        assert!(message.contains("pod_bridge_interface"), "{message}");
        assert!(message.contains("1 to 15 bytes"), "{message}");
    }
    for bad in ["sixteen-bytes-xx", "veth/", "cali:"] {
        let message = err(&["--pod-interface-name-prefix", bad], &[], None);
        assert!(message.contains("pod_interface_name_prefix"), "{message}");
        assert!(message.contains("1 to 15 bytes"), "{message}");
    }
    let loaded = ok(
        &[
            "--pod-bridge-interface",
            "fifteen-bytes-x",
            "--pod-interface-name-prefix",
            ".",
        ],
        &[],
        None,
    );
    assert_eq!(
        loaded.config.pod_bridge_interface.as_deref(),
        Some("fifteen-bytes-x")
    );
    assert_eq!(
        loaded.config.pod_interface_name_prefix.as_deref(),
        Some(".")
    );
    // Empty means unset, as for --hostname-override, so `--print-config` output reads back.
    let loaded = ok(
        &["--pod-bridge-interface="],
        &[],
        Some("pod_bridge_interface = \"cni0\""),
    );
    assert_eq!(loaded.config.pod_bridge_interface, None);
    assert_eq!(
        *loaded.provenance.of(Field::PodBridgeInterface),
        Source::Flag
    );
}

#[test]
fn nodeport_addresses_accepts_primary_all_and_cidrs_in_combination() {
    let net = |text: &str| -> IpNet { text.parse().unwrap() };
    let parsed = |value: &str| {
        ok(&["--nodeport-addresses", value], &[], None)
            .config
            .nodeport_addresses
    };
    let addresses = parsed("primary,192.0.2.0/24");
    assert_eq!(
        addresses,
        NodePortAddresses {
            primary: true,
            all: false,
            cidrs: vec![net("192.0.2.0/24")],
        }
    );
    assert!(addresses.selects("198.51.100.1".parse().unwrap(), true));
    assert!(addresses.selects("192.0.2.9".parse().unwrap(), false));
    assert!(!addresses.selects("198.51.100.1".parse().unwrap(), false));
    assert!(!addresses.all_of(IpFamily::V4));

    let addresses = parsed("all");
    assert!(addresses.all && !addresses.primary && addresses.cidrs.is_empty());
    assert!(addresses.all_of(IpFamily::V4) && addresses.all_of(IpFamily::V6));

    let addresses = parsed("0.0.0.0/0");
    assert!(!addresses.primary && !addresses.all);
    assert!(addresses.all_of(IpFamily::V4));
    assert!(!addresses.all_of(IpFamily::V6));
    assert!(parsed("::/0").all_of(IpFamily::V6));

    assert_eq!(parsed("Primary"), NodePortAddresses::primary());
    let loaded = ok(
        &[],
        &[],
        Some("nodeport_addresses = [\"2001:db8::/64\", \"all\"]"),
    );
    assert_eq!(
        loaded.config.nodeport_addresses,
        NodePortAddresses {
            primary: false,
            all: true,
            cidrs: vec![net("2001:db8::/64")],
        }
    );
}

#[test]
fn empty_nodeport_addresses_mean_primary() {
    let loaded = ok(
        &["--nodeport-addresses="],
        &[],
        Some("nodeport_addresses = \"all\""),
    );
    assert!(loaded.config.nodeport_addresses.is_primary_only());
    assert_eq!(
        *loaded.provenance.of(Field::NodePortAddresses),
        Source::Flag
    );
    let loaded = ok(&[], &[], Some("nodeport_addresses = []"));
    assert_eq!(
        loaded.config.nodeport_addresses,
        NodePortAddresses::primary()
    );
}

#[test]
fn localhost_nodeports_are_rejected() {
    for value in ["localhost", "primary,localhost", "127.0.0.0/8", "::1/128"] {
        let message = err(&["--nodeport-addresses", value], &[], None);
        assert!(
            message.contains("localhost NodePorts are not supported"),
            "{message}"
        );
        assert!(message.contains("nodeport_addresses"), "{message}");
    }
}

#[test]
fn a_bad_nodeport_cidr_is_rejected_naming_the_item() {
    let message = err(&["--nodeport-addresses", "primary,192.0.2.0/33"], &[], None);
    assert!(
        message.contains("`192.0.2.0/33` is not a CIDR"),
        "{message}"
    );
    assert!(message.contains("`primary`, `all` or CIDRs"), "{message}");
    assert!(message.contains("flag --nodeport-addresses"), "{message}");
    let message = err(
        &[],
        &[("NODEPROXY_NODEPORT_ADDRESSES", "192.0.2.1/24")],
        None,
    );
    assert!(message.contains("did you mean 192.0.2.0/24"), "{message}");
    let message = err(&[], &[], Some("nodeport_addresses = \"192.0.2.1\""));
    assert!(
        message.contains("192.0.2.1/32 for one address"),
        "{message}"
    );
    let message = err(&[], &[], Some("nodeport_addresses = \"primaryy\""));
    assert!(message.contains("`primaryy` is not a CIDR"), "{message}");
}

#[test]
fn service_cidr_takes_one_cidr_per_family() {
    let loaded = ok(
        &["--service-cidr", "10.96.0.0/12,fd00:10:96::/112"],
        &[],
        None,
    );
    assert_eq!(
        loaded.config.service_cidr_of(IpFamily::V6),
        Some("fd00:10:96::/112".parse().unwrap())
    );
    let message = err(&["--service-cidr", "10.96.0.0/12,10.97.0.0/16"], &[], None);
    assert!(message.contains("service_cidr"), "{message}");
    assert!(message.contains("two IPv4 CIDRs"), "{message}");
    let message = err(&[], &[], Some("service_cidr = \"10.96.0.1\""));
    assert!(message.contains("write the service network"), "{message}");
}

#[test]
fn master_must_be_an_http_or_https_url() {
    for good in [
        "https://api.example.com",
        "HTTPS://10.0.0.1:6443",
        "http://[::1]:8080/prefix",
    ] {
        let loaded = ok(&["--master", good], &[], None);
        assert_eq!(loaded.config.master.as_deref(), Some(good));
    }
    for bad in [
        "10.0.0.1:6443",
        "ftp://host",
        "https://",
        "https://host:99999",
        "https://host:0",
        "https://user:secret@host",
        "https://[::1",
        "https://ho st",
    ] {
        let message = err(&["--master", bad], &[], None);
        assert!(message.contains("master"), "{message}");
        assert!(message.contains("http:// or https:// URL"), "{message}");
    }
    assert_eq!(ok(&["--master="], &[], None).config.master, None);
}

#[test]
fn an_empty_kubeconfig_means_unset_and_an_empty_lock_file_is_rejected() {
    let loaded = ok(&["--kubeconfig="], &[], Some("kubeconfig = \"/k\""));
    assert_eq!(loaded.config.kubeconfig, None);
    let message = err(&[], &[], Some("lock_file = \"\""));
    assert!(message.contains("lock_file"), "{message}");
    assert!(
        message.contains("/run/nodeproxy/nodeproxy.lock"),
        "{message}"
    );
    assert_eq!(
        Config::default().lock_file,
        PathBuf::from("/run/nodeproxy/nodeproxy.lock")
    );
}

#[test]
fn bind_addresses_default_to_kube_proxy_ports_and_empty_disables_them() {
    let config = Config::default();
    assert_eq!(
        config.healthz_bind_address,
        Some("0.0.0.0:10256".parse().unwrap())
    );
    assert_eq!(
        config.metrics_bind_address,
        Some("127.0.0.1:10249".parse().unwrap())
    );
    let loaded = ok(
        &["--healthz-bind-address=", "--metrics-bind-address", ""],
        &[],
        None,
    );
    assert_eq!(loaded.config.healthz_bind_address, None);
    assert_eq!(loaded.config.metrics_bind_address, None);
    let rendered = render_effective(&loaded.config, &loaded.provenance);
    assert!(
        rendered
            .contains("healthz_bind_address = \"\"  # flag --healthz-bind-address (disabled)\n"),
        "{rendered}"
    );
}

#[test]
fn a_bind_address_without_a_port_or_with_port_0_is_rejected() {
    let message = err(&["--healthz-bind-address", "192.0.2.1"], &[], None);
    assert!(message.contains("healthz_bind_address"), "{message}");
    assert!(message.contains("has no port"), "{message}");
    assert!(message.contains("192.0.2.1:10256"), "{message}");
    let message = err(&[], &[], Some("metrics_bind_address = \"[::]:0\""));
    assert!(message.contains("port 0 is not allowed"), "{message}");
    let message = err(&[], &[], Some("metrics_bind_address = \"nowhere\""));
    assert!(message.contains("ADDRESS:PORT"), "{message}");
}

#[test]
fn healthz_and_metrics_on_the_same_port_are_rejected_naming_both_fields() {
    let message = err(&["--metrics-bind-address", "127.0.0.1:10256"], &[], None);
    assert!(message.contains("metrics_bind_address"), "{message}");
    assert!(
        message.contains("healthz_bind_address `0.0.0.0:10256` (from default)"),
        "{message}"
    );
    // Different families with specific addresses do not collide; `::` takes IPv4 too.
    ok(
        &[
            "--healthz-bind-address",
            "0.0.0.0:9000",
            "--metrics-bind-address",
            "[::1]:9000",
        ],
        &[],
        None,
    );
    err(
        &[
            "--healthz-bind-address",
            "[::]:9000",
            "--metrics-bind-address",
            "127.0.0.1:9000",
        ],
        &[],
        None,
    );
}

#[test]
fn durations_round_trip_in_kube_proxy_syntax() {
    for (text, nanos, printed) in [
        ("1h30m", 5_400_000_000_000, "1h30m"),
        ("500ms", 500_000_000, "500ms"),
        ("1.5s", 1_500_000_000, "1.5s"),
        ("0", 0, "0s"),
        ("0s", 0, "0s"),
        ("90s", 90_000_000_000, "1m30s"),
        ("1h0m5s", 3_605_000_000_000, "1h5s"),
        ("1m0.25s", 60_250_000_000, "1m0.25s"),
        (".5m", 30_000_000_000, "30s"),
        ("2us", 2_000, "2µs"),
        ("1.5µs", 1_500, "1.5µs"),
        ("100ns", 100, "100ns"),
        ("+2s", 2_000_000_000, "2s"),
    ] {
        let parsed = parse_duration(text).unwrap();
        assert_eq!(parsed, Duration::from_nanos(nanos), "{text}");
        assert_eq!(format_duration(parsed), printed, "{text}");
        assert_eq!(parse_duration(printed).unwrap(), parsed, "{text}");
    }
}

#[test]
fn invalid_durations_are_rejected_with_the_syntax() {
    for (text, why) in [
        ("-1s", "must not be negative"),
        ("30", "lacks a unit"),
        ("1d", "unknown unit `d`"),
        ("s", "does not start with a number"),
        ("1.5.5s", "lacks a unit"),
        ("9999999999h", "too long"),
    ] {
        let message = err(&["--sync-period", text], &[], None);
        assert!(message.contains(why), "{text}: {message}");
        assert!(message.contains("sync_period"), "{message}");
        assert!(message.contains("1h30m"), "{message}");
    }
    let message = err(&[], &[], Some("sync_period = 30"));
    assert!(message.contains("lacks a unit"), "{message}");
    let message = err(&[], &[], Some("min_sync_period = true"));
    assert!(message.contains("duration string"), "{message}");
}

#[test]
fn sync_period_must_be_positive_and_min_sync_period_at_most_sync_period() {
    let message = err(&["--sync-period", "0s"], &[], None);
    assert!(message.contains("sync_period `0s`"), "{message}");
    assert!(message.contains("longer than 0"), "{message}");
    let loaded = ok(&["--min-sync-period", "0"], &[], None);
    assert_eq!(loaded.config.min_sync_period, Duration::ZERO);
    let loaded = ok(&["--min-sync-period", "30s"], &[], None);
    assert_eq!(loaded.config.min_sync_period, loaded.config.sync_period);

    let message = err(
        &["--min-sync-period", "1m", "--sync-period", "30s"],
        &[],
        None,
    );
    assert!(message.contains("min_sync_period `1m`"), "{message}");
    assert!(message.contains("flag --min-sync-period"), "{message}");
    assert!(
        message.contains("sync_period `30s` (from flag --sync-period)"),
        "{message}"
    );
    let message = err(&[], &[], Some("min_sync_period = \"31s\""));
    assert!(message.contains(&format!("file {FILE}")), "{message}");
    assert!(message.contains("(from default)"), "{message}");
}

#[test]
fn health_timeout_is_twice_the_sync_period() {
    assert_eq!(Config::default().health_timeout(), Duration::from_secs(60));
    let loaded = ok(&["--sync-period", "1h30m"], &[], None);
    assert_eq!(
        loaded.config.health_timeout(),
        Duration::from_secs(3 * 3600)
    );
}

#[test]
fn cleanup_kube_proxy_accepts_kube_proxy_boolean_spellings() {
    assert!(
        ok(&["--cleanup-kube-proxy"], &[], None)
            .config
            .cleanup_kube_proxy
    );
    assert!(
        ok(&[], &[("NODEPROXY_CLEANUP_KUBE_PROXY", "T")], None)
            .config
            .cleanup_kube_proxy
    );
    let loaded = ok(
        &["--cleanup-kube-proxy=0"],
        &[],
        Some("cleanup_kube_proxy = true"),
    );
    assert!(!loaded.config.cleanup_kube_proxy);
    let message = err(&[], &[], Some("cleanup_kube_proxy = \"yes\""));
    assert!(message.contains("cleanup_kube_proxy"), "{message}");
    assert!(message.contains("TOML boolean"), "{message}");
}

#[test]
fn a_kube_proxy_yaml_key_with_an_acronym_gets_a_hint() {
    for (key, hint) in [
        ("clusterCIDR", "cluster_cidr"),
        ("detectLocalMode", "detect_local_mode"),
        ("healthzBindAddress", "healthz_bind_address"),
        ("syncPeriod", "sync_period"),
    ] {
        let message = err(&[], &[], Some(&format!("{key} = \"x\"")));
        assert!(
            message.contains(&format!("did you mean `{hint}`")),
            "{message}"
        );
    }
}

#[test]
fn masquerade_all_accepts_kube_proxy_boolean_spellings() {
    assert!(ok(&["--masquerade-all"], &[], None).config.masquerade_all);
    assert!(
        ok(&["--masquerade-all=true"], &[], None)
            .config
            .masquerade_all
    );
    let loaded = ok(
        &["--masquerade-all=false"],
        &[],
        Some("masquerade_all = true"),
    );
    assert!(!loaded.config.masquerade_all);
    assert!(
        ok(&[], &[("NODEPROXY_MASQUERADE_ALL", "1")], None)
            .config
            .masquerade_all
    );
    assert!(err(&[], &[], Some("masquerade_all = \"true\"")).contains("TOML boolean"));
}

#[test]
fn from_file_in_the_config_file_may_be_a_single_path() {
    let loaded = ok(&[], &[], Some("from_file = \"/a,b.yaml\""));
    assert_eq!(loaded.config.from_file, vec![PathBuf::from("/a,b.yaml")]);
}

#[test]
fn the_config_file_can_be_named_by_the_environment() {
    let loaded = load_with(
        ["nodeproxy".into()],
        &|name| (name == CONFIG_ENV_VAR).then(|| FILE.to_string()),
        &|_| Ok("log_format = \"json\"".to_string()),
    )
    .unwrap();
    assert_eq!(loaded.config.log_format, LogFormat::Json);
    assert_eq!(
        loaded.provenance.config_file,
        Some((PathBuf::from(FILE), Source::Env(CONFIG_ENV_VAR.to_string())))
    );
}

#[test]
fn a_missing_or_malformed_config_file_is_an_error_naming_the_path() {
    let message = load_with(
        ["nodeproxy".into(), "--config".into(), "/nope.toml".into()],
        &|_| None,
        &|_| Err(std::io::Error::from(std::io::ErrorKind::NotFound)),
    )
    .unwrap_err()
    .to_string();
    assert!(message.contains("/nope.toml"), "{message}");
    assert!(message.contains("flag --config"), "{message}");
    let message = err(&[], &[], Some("masquerade_bit = "));
    assert!(message.contains("not valid TOML"), "{message}");
    assert!(message.contains(FILE), "{message}");
}

#[test]
fn load_reads_a_real_config_file() {
    let path =
        std::env::temp_dir().join(format!("nodeproxy-config-test-{}.toml", std::process::id()));
    std::fs::write(&path, "masquerade_bit = 9\n").unwrap();
    let result = load(
        ["nodeproxy".into(), "--config".into(), path.clone().into()],
        &|_| None,
    );
    std::fs::remove_file(&path).unwrap();
    assert_eq!(result.unwrap().config.masquerade_bit, 9);
}

#[test]
fn print_config_output_parses_back_as_toml_and_reproduces_the_same_config() {
    let loaded = ok(
        &[
            "--hostname-override",
            "Worker-1",
            "--masquerade-all",
            "--from-file",
            "/tmp/with \"quotes\" and \\ backslash.yaml",
        ],
        &[("NODEPROXY_CLUSTER_CIDR", "10.244.0.0/16,fd00::/56")],
        Some("masquerade_bit = 3\nlog_format = \"json\""),
    );
    let rendered = render_effective(&loaded.config, &loaded.provenance);
    assert!(
        rendered.contains("hostname_override = \"worker-1\"  # flag --hostname-override\n"),
        "{rendered}"
    );
    assert!(
        rendered.contains("  # env NODEPROXY_CLUSTER_CIDR\n"),
        "{rendered}"
    );
    assert!(
        rendered.contains(&format!("masquerade_bit = 3  # file {FILE}\n")),
        "{rendered}"
    );
    assert!(rendered.contains("nodeport_addresses = \"primary\"  # default\n"));
    let reloaded = ok(&[], &[], Some(&rendered));
    assert_eq!(reloaded.config, loaded.config);

    // Every new kind of value: durations, bind addresses (one disabled), the derived
    // detect-local-mode default, nodeport keyword/CIDR combinations, optional strings.
    let loaded = ok(
        &[
            "--nodeport-addresses",
            "primary,192.0.2.0/24,::/0",
            "--sync-period",
            "1h30m",
            "--min-sync-period",
            "1.5s",
            "--healthz-bind-address=",
            "--metrics-bind-address",
            "[::1]:9100",
            "--cleanup-kube-proxy",
            "--pod-interface-name-prefix",
            "veth",
        ],
        &[
            ("NODEPROXY_CLUSTER_CIDR", "10.244.0.0/16"),
            ("NODEPROXY_SERVICE_CIDR", "10.96.0.0/12,fd00:10:96::/112"),
            ("NODEPROXY_KUBECONFIG", "/etc/kubernetes/kube-proxy.conf"),
            ("NODEPROXY_MASTER", "https://192.0.2.10:6443"),
        ],
        Some("lock_file = \"/var/lock/np.lock\"\npod_bridge_interface = \"cni0\""),
    );
    let rendered = render_effective(&loaded.config, &loaded.provenance);
    for line in [
        "detect_local_mode = \"ClusterCIDR\"  # default (ClusterCIDR when cluster_cidr is \
         set, else NodeCIDR)\n",
        "nodeport_addresses = \"primary,192.0.2.0/24,::/0\"  # flag --nodeport-addresses\n",
        "sync_period = \"1h30m\"  # flag --sync-period\n",
        "min_sync_period = \"1.5s\"  # flag --min-sync-period\n",
        "healthz_bind_address = \"\"  # flag --healthz-bind-address (disabled)\n",
        "metrics_bind_address = \"[::1]:9100\"  # flag --metrics-bind-address\n",
        "cleanup_kube_proxy = true  # flag --cleanup-kube-proxy\n",
        "master = \"https://192.0.2.10:6443\"  # env NODEPROXY_MASTER\n",
    ] {
        assert!(rendered.contains(line), "{line}\n{rendered}");
    }
    let reloaded = ok(&[], &[], Some(&rendered));
    assert_eq!(reloaded.config, loaded.config);

    let defaults = ok(&[], &[], None);
    let rendered = render_effective(&defaults.config, &defaults.provenance);
    assert!(rendered.contains("# config file: none"), "{rendered}");
    assert_eq!(ok(&[], &[], Some(&rendered)).config, Config::default());
}

#[test]
fn mode_flags_and_verbosity_come_through_load() {
    let loaded = ok(&["--print-config", "-vv"], &[], None);
    assert_eq!(loaded.mode, Mode::PrintConfig);
    assert_eq!(loaded.verbosity, 2);
    assert_eq!(ok(&["--dry-run", "--v=4"], &[], None).mode, Mode::DryRun);
    assert_eq!(ok(&["--once"], &[], None).mode, Mode::Once);
    assert_eq!(ok(&["--cleanup"], &[], None).mode, Mode::Cleanup);
}

#[test]
fn usage_errors_carry_clap_message_and_exit_2() {
    let error = run(&["--no-such-flag"], &[], None).unwrap_err();
    assert!(matches!(error, ConfigError::Usage(_)));
    assert!(error.to_string().contains("--no-such-flag"), "{error}");
    assert_eq!(error.exit_code(), 2);
    let error = run(&["--dry-run", "--cleanup"], &[], None).unwrap_err();
    assert!(matches!(error, ConfigError::Usage(_)), "{error}");
}

#[test]
fn help_and_version_are_not_failures() {
    for flag in ["--help", "--version"] {
        let error = run(&[flag], &[], None).unwrap_err();
        assert!(matches!(error, ConfigError::HelpOrVersion(_)), "{error}");
        assert_eq!(error.exit_code(), 0);
    }
    let help = run(&["--help"], &[], None).unwrap_err().to_string();
    assert!(help.contains("--hostname-override"), "{help}");
    assert!(help.contains("/etc/nodeproxy/config.toml"), "{help}");
}

#[test]
fn a_cluster_cidr_containing_a_cluster_ip_is_reported() {
    let config = Config {
        cluster_cidr: vec![
            "10.96.0.0/12".parse().unwrap(),
            "fd00:10:244::/56".parse().unwrap(),
        ],
        ..Config::default()
    };
    let ips = vec![
        (
            "kube-system/kube-dns".to_string(),
            "10.96.0.10".parse().unwrap(),
        ),
        (
            "default/kubernetes".to_string(),
            "10.96.0.1".parse().unwrap(),
        ),
        ("default/outside".to_string(), "192.0.2.1".parse().unwrap()),
    ];
    let messages = overlapping_cluster_cidr(&config, &ips);
    assert_eq!(messages.len(), 1, "{messages:?}");
    assert!(
        messages[0].starts_with(
            "--cluster-cidr 10.96.0.0/12 contains ClusterIP 10.96.0.1 of default/kubernetes \
             (and 1 other ClusterIP): the cluster CIDR must be the pod network, not the \
             service network"
        ),
        "{}",
        messages[0]
    );
    let pods_only = Config {
        cluster_cidr: vec!["10.244.0.0/16".parse().unwrap()],
        ..Config::default()
    };
    assert!(overlapping_cluster_cidr(&pods_only, &ips).is_empty());
}

#[test]
fn unknown_nodeproxy_environment_variables_are_named_with_the_closest_valid_one() {
    let names = [
        "NODEPROXY_CLUSTER_CIRD",
        "NODEPROXY_CLUSTER_CIDR",
        "NODEPROXY_LOG",
        "NODEPROXY_EXTRA_ARGS",
        "NODEPROXY_CONFIG",
        "NODEPROXY_SOMETHING_ELSE_ENTIRELY",
        "PATH",
        "KUBECONFIG",
    ]
    .map(String::from);
    let warnings = unknown_env_vars(names);
    assert_eq!(warnings.len(), 2, "{warnings:?}");
    assert!(
        warnings[0].contains("NODEPROXY_CLUSTER_CIRD")
            && warnings[0].contains("did you mean NODEPROXY_CLUSTER_CIDR?"),
        "{warnings:?}"
    );
    assert!(
        warnings[1].contains("NODEPROXY_SOMETHING_ELSE_ENTIRELY")
            && !warnings[1].contains("did you mean"),
        "{warnings:?}"
    );
    assert_eq!(edit_distance("kitten", "sitting"), 3);
    assert_eq!(edit_distance("", "abc"), 3);
}

#[test]
fn the_whole_command_line_is_internally_consistent() {
    command().debug_assert();
}

#[test]
fn masquerade_all_accepts_bare_and_explicit_values() {
    let cli = command()
        .try_get_matches_from(["nodeproxy", "--masquerade-all"])
        .unwrap();
    assert_eq!(
        cli.get_one::<String>("masquerade_all").map(String::as_str),
        Some("true")
    );
    let cli = command()
        .try_get_matches_from(["nodeproxy", "--masquerade-all=false"])
        .unwrap();
    assert_eq!(
        cli.get_one::<String>("masquerade_all").map(String::as_str),
        Some("false")
    );
    // Without `=`, the next word is not taken as the flag's value.
    let cli = command()
        .try_get_matches_from(["nodeproxy", "--masquerade-all", "--once"])
        .unwrap();
    assert_eq!(
        cli.get_one::<String>("masquerade_all").map(String::as_str),
        Some("true")
    );
    assert!(cli.get_flag("once"));
}

#[test]
fn cleanup_kube_proxy_accepts_bare_and_explicit_values() {
    let cli = command()
        .try_get_matches_from(["nodeproxy", "--cleanup-kube-proxy", "--once"])
        .unwrap();
    assert_eq!(
        cli.get_one::<String>("cleanup_kube_proxy")
            .map(String::as_str),
        Some("true")
    );
    assert!(cli.get_flag("once"));
    let cli = command()
        .try_get_matches_from(["nodeproxy", "--cleanup-kube-proxy=false"])
        .unwrap();
    assert_eq!(
        cli.get_one::<String>("cleanup_kube_proxy")
            .map(String::as_str),
        Some("false")
    );
}

#[test]
fn help_names_every_flag_config_key_and_environment_variable() {
    let help = command().render_long_help().to_string();
    assert!(
        help.contains("NODEPROXY_CONFIG"),
        "help lacks NODEPROXY_CONFIG:\n{help}"
    );
    for field in Field::ALL {
        for name in [field.flag(), field.key().to_string(), field.env_var()] {
            assert!(help.contains(&name), "help lacks {name}:\n{help}");
        }
    }
}

#[test]
fn a_config_file_larger_than_16_mib_is_refused_without_reading_it_all() {
    let path = std::env::temp_dir().join(format!("nodeproxy-big-config-{}", std::process::id()));
    let file = std::fs::File::create(&path).unwrap();
    file.set_len((16 << 20) + 1).unwrap();
    let error = super::load::read_config_file(&path).unwrap_err();
    std::fs::remove_file(&path).unwrap();
    assert!(error.to_string().contains("larger than 16 MiB"), "{error}");
    let path = std::env::temp_dir().join(format!("nodeproxy-small-config-{}", std::process::id()));
    std::fs::write(&path, "sync_period = \"5s\"\n").unwrap();
    let text = super::load::read_config_file(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(text, "sync_period = \"5s\"\n");
}
