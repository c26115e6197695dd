//! Unit tests of the Events' rate limit and their content.
use super::*;
use crate::nft::ReplyKind;

fn key(name: &str) -> ObjectKey {
    ("Service".into(), "shop".into(), name.into())
}

const LIMITS: Limits = Limits {
    per_object: Rate {
        burst: 3,
        interval: Duration::from_secs(60),
    },
    global: Rate {
        burst: 5,
        interval: Duration::from_secs(10),
    },
};

#[test]
fn one_object_gets_its_burst_then_one_event_per_interval() {
    let mut l = Limiter::new(LIMITS);
    let t0 = Instant::now();
    let admitted = (0..10).filter(|_| l.admit(&key("web"), t0)).count();
    assert_eq!(admitted, 3);
    // Less than one interval later: still nothing.
    assert!(!l.admit(&key("web"), t0 + Duration::from_secs(59)));
    // One interval: one more, and only one.
    assert!(l.admit(&key("web"), t0 + Duration::from_secs(60)));
    assert!(!l.admit(&key("web"), t0 + Duration::from_secs(61)));
    // A long quiet spell refills the whole burst, never more.
    let later = t0 + Duration::from_secs(3600);
    assert_eq!((0..10).filter(|_| l.admit(&key("web"), later)).count(), 3);
}

#[test]
fn a_flapping_object_does_not_take_the_budget_of_the_others() {
    let mut l = Limiter::new(LIMITS);
    let t0 = Instant::now();
    for i in 0..100 {
        l.admit(&key("flapping"), t0 + Duration::from_millis(i * 100));
    }
    assert!(l.admit(&key("other"), t0 + Duration::from_secs(10)));
}

#[test]
fn the_global_cap_holds_across_objects() {
    let mut l = Limiter::new(LIMITS);
    let t0 = Instant::now();
    let admitted = (0..20)
        .filter(|i| l.admit(&key(&format!("svc-{i}")), t0))
        .count();
    assert_eq!(admitted, 5);
    // A refused Event costs the object nothing: once the global budget is back, it gets one.
    assert!(l.admit(&key("svc-19"), t0 + Duration::from_secs(10)));
    assert!(!l.admit(&key("svc-18"), t0 + Duration::from_secs(10)));
}

#[test]
fn idle_objects_are_forgotten_once_their_budget_is_whole() {
    let mut l = Limiter::new(LIMITS);
    let t0 = Instant::now();
    l.admit(&key("a"), t0);
    l.admit(&key("b"), t0 + Duration::from_secs(50));
    l.forget_idle(t0 + Duration::from_secs(61));
    assert_eq!(
        l.tracked(),
        1,
        "a is whole again after one interval, b is not"
    );
    l.forget_idle(t0 + Duration::from_secs(200));
    assert_eq!(l.tracked(), 0);
}

#[test]
fn the_default_limits_are_the_documented_ones() {
    let mut l = Limiter::new(Limits::DEFAULT);
    let t0 = Instant::now();
    let n = (0..50).filter(|_| l.admit(&key("web"), t0)).count();
    assert_eq!(n, usize::try_from(PER_OBJECT_BURST).unwrap());
    assert!(!l.admit(&key("web"), t0 + PER_OBJECT_INTERVAL / 2));
    assert!(l.admit(&key("web"), t0 + PER_OBJECT_INTERVAL));
}

fn name() -> ServiceName {
    ServiceName::new("shop", "web")
}

#[test]
fn the_warning_names_the_service_the_refused_object_the_error_and_the_node() {
    let why = Rejection {
        op: "add element",
        object: "element 203.0.113.10 . tcp . 80 : goto pick-1 in map service-ips of table ip \
                 nodeproxy"
            .into(),
        error: ReplyKind::NotFound.errno().to_string(),
    };
    let n = Notice::rejected(&name(), Some("uid-1"), &why, "node-a");
    assert!(n.warning);
    assert_eq!(n.reason, "KernelRejected");
    let r = &n.regarding;
    assert_eq!(
        (
            r.api_version.as_deref(),
            r.kind.as_deref(),
            r.namespace.as_deref(),
            r.name.as_deref(),
            r.uid.as_deref()
        ),
        (
            Some("v1"),
            Some("Service"),
            Some("shop"),
            Some("web"),
            Some("uid-1")
        )
    );
    for part in [
        "node node-a",
        "add element element 203.0.113.10 . tcp . 80",
        "No such file or directory",
        "quarantined",
    ] {
        assert!(n.note.contains(part), "{part:?} not in {:?}", n.note);
    }
    let ok = Notice::programmed(&name(), None, "node-a");
    assert!(!ok.warning);
    assert_eq!(ok.reason, "Programmed");
    assert_eq!(ok.key(), n.key());
}

#[test]
fn a_long_note_is_cut_to_what_the_api_server_accepts() {
    let why = Rejection {
        op: "add element",
        object: "é".repeat(2000),
        error: "Invalid argument".into(),
    };
    let n = Notice::rejected(&name(), None, &why, "node-a");
    assert!(n.note.len() <= MAX_NOTE, "{}", n.note.len());
    assert!(n.note.ends_with('…'));
}

#[test]
fn the_node_is_told_which_version_starts_as_kube_proxy_does() {
    let n = Notice::starting("node-a");
    assert!(!n.warning);
    assert_eq!(n.reason, "Starting");
    assert_eq!(
        n.note,
        format!("Starting nodeproxy {}.", env!("CARGO_PKG_VERSION"))
    );
    assert_eq!(n.regarding.kind.as_deref(), Some("Node"));
    assert_eq!(n.regarding.uid.as_deref(), Some("node-a"));
    assert_eq!(n.regarding.namespace, None);
}
