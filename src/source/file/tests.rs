//! Tests of reading JSON list items from their text ([`raw`]): whatever the input, it reads
//! exactly as through generic values; and of merging the two threads' parts in file order.

use std::sync::atomic::{AtomicUsize, Ordering};

use super::*;

/// How many objects were decoded from their text ([`read_raw`]), by every test so far.
pub(super) static RAW_READS: AtomicUsize = AtomicUsize::new(0);

/// Reads `text` as a JSON file both ways and asserts the same outcome (objects, reports, and
/// the error with its position); returns the outcome as text for further checks.
fn both_ways(text: &str) -> String {
    let name = Path::new("input.json");
    let fast = format!("{:?}", load_text(name, text));
    let slow = format!("{:?}", load_text_through_values(name, text));
    assert_eq!(
        fast, slow,
        "read from the items' text and through values differ on\n{text}"
    );
    fast
}

fn list(items: &[String]) -> String {
    format!(
        "{{\"apiVersion\": \"v1\", \"kind\": \"List\", \"items\": [\n{}\n]}}",
        items.join(",\n")
    )
}

fn service(i: usize) -> String {
    format!(
        r#"{{"apiVersion": "v1", "kind": "Service", "metadata": {{"namespace": "ns", "name": "s{i}", "labels": {{"a": "1", "b": "2"}}}}, "spec": {{"clusterIP": "10.96.0.{}", "ports": [{{"port": 80, "protocol": "TCP"}}]}}}}"#,
        i % 250 + 1
    )
}

fn slice(i: usize) -> String {
    format!(
        r#"{{"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "metadata": {{"namespace": "ns", "name": "s{i}-x", "labels": {{"kubernetes.io/service-name": "s{i}"}}}}, "addressType": "IPv4", "endpoints": [{{"addresses": ["10.1.0.{}"], "conditions": {{"ready": true}}}}], "ports": [{{"port": 8080, "protocol": "TCP"}}]}}"#,
        i % 250 + 1
    )
}

#[test]
fn the_corpus_reads_the_same_from_the_items_text_as_through_values() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/file_reader");
    let mut lists = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        // The YAML seeds, written as one JSON list of their documents' items.
        let mut items = Vec::new();
        for doc in serde_yaml_ng::Deserializer::from_str(&text) {
            let Ok(value) = Value::deserialize(doc) else {
                continue;
            };
            flatten(value, &mut |v| items.push(v.to_string()));
        }
        for text in [text.clone(), list(&items)] {
            let shown = both_ways(&text);
            if shown.starts_with("Ok") && text.contains("\"items\"") {
                lists += 1;
            }
            // Cut short, every way of being wrong in the middle of an item.
            for end in (0..text.len())
                .step_by(97)
                .filter(|&e| text.is_char_boundary(e))
            {
                both_ways(&text[..end]);
            }
        }
    }
    assert!(lists >= 16, "only {lists} lists read");
}

#[test]
fn items_the_check_leaves_to_values_read_as_through_values() {
    let svc = service(1);
    let unusual = [
        // Repeated keys, at the top, in metadata, in labels, deep in spec.
        svc.replacen("\"kind\": \"Service\"", "\"kind\": \"Service\", \"kind\": \"Service\"", 1),
        svc.replacen("\"name\": \"s1\"", "\"name\": \"s1\", \"name\": \"s2\"", 1),
        svc.replacen("\"a\": \"1\"", "\"a\": \"1\", \"a\": \"3\"", 1),
        svc.replacen("\"port\": 80", "\"port\": 80, \"port\": 81", 1),
        // The same key written once plainly and once with an escape.
        svc.replacen("\"a\": \"1\"", "\"a\": \"1\", \"\\u0061\": \"3\"", 1),
        // Escapes in a key, in the kind, in the name.
        svc.replacen("\"kind\"", "\"k\\u0069nd\"", 1),
        svc.replacen("\"Service\"", "\"Serv\\u0069ce\"", 1),
        svc.replacen("\"s1\"", "\"s\\u0031\"", 1),
        svc.replacen("\"s1\"", "\"s\\\"1\"", 1),
        // A lone surrogate, which skipping lets through and parsing does not; a pair.
        svc.replacen("\"1\"", "\"\\ud800\"", 1),
        svc.replacen("\"1\"", "\"\\udc00\"", 1),
        svc.replacen("\"1\"", "\"\\ud83d\\ude00\"", 1),
        // Metadata that is not a mapping; a kind that is not a string; no kind.
        svc.replacen("\"metadata\": {", "\"metadata\": [], \"x\": {", 1),
        svc.replacen("\"Service\"", "7", 1),
        svc.replacen("\"kind\": \"Service\",", "", 1),
        // Another apiVersion, a kind nodeproxy does not read, one that does not decode.
        svc.replacen("\"v1\"", "\"v2\"", 1),
        svc.replacen("\"Service\"", "\"ConfigMap\"", 1),
        svc.replacen("\"port\": 80", "\"port\": \"eighty\"", 1),
        svc.replacen("\"port\": 80", "\"port\": 80.5", 1),
        // Numbers that skipping accepts and parsing finds out of range, or nearly.
        svc.replacen("\"port\": 80", "\"port\": 1e400", 1),
        svc.replacen("\"port\": 80", "\"port\": -1E400", 1),
        svc.replacen("\"port\": 80", &format!("\"port\": {}", "9".repeat(400)), 1),
        svc.replacen("\"port\": 80", &format!("\"port\": 1.{}", "9".repeat(400)), 1),
        svc.replacen("\"port\": 80", "\"port\": 1e300", 1),
        svc.replacen("\"port\": 80", "\"port\": 18446744073709551616", 1),
        svc.replacen("\"a\": \"1\"", "\"a\": \"1\", \"n\": 1e999", 1),
        // Keys in another order, name before namespace, whitespace everywhere.
        r#"{"spec": {"clusterIP": "10.96.0.9", "ports": [{"port": 80}]}, "metadata": {"name": "z", "namespace": "ns"}, "kind": "Service", "apiVersion": "v1"}"#.to_string(),
        svc.replace(", ", " ,\n\t ").replace(": ", " :\r\n "),
        // A nested list; a bare value; an empty mapping.
        format!(r#"{{"kind": "List", "items": [{svc}, {}]}}"#, slice(1)),
        "7".to_string(),
        "{}".to_string(),
    ];
    for item in &unusual {
        both_ways(&list(&[service(2), item.clone(), slice(3)]));
    }
    // Nested as deep as serde_json allows, and deeper.
    for depth in [90, 99, 100, 101, 124, 125, 126, 127] {
        let deep = format!("{}1{}", "[".repeat(depth), "]".repeat(depth));
        let item = svc.replacen(
            "\"a\": \"1\"",
            &format!("\"a\": \"1\", \"deep\": {deep}"),
            1,
        );
        both_ways(&list(&[item]));
    }
}

#[test]
fn a_repeated_key_in_an_item_is_the_error_reading_through_values_reports() {
    let svc = service(1).replacen("\"port\": 80", "\"port\": 80, \"port\": 81", 1);
    let items: Vec<String> = (0..200).map(service).chain([svc]).collect();
    let shown = both_ways(&list(&items));
    assert!(shown.contains("duplicate key `port`"), "{shown}");
    assert!(shown.contains("line: 202"), "{shown}");
}

#[test]
fn many_items_read_in_file_order_and_a_document_that_was_not_a_list_is_taken_back() {
    // Far more items than the queue holds, so that the parsing thread converts some itself,
    // and the same object twice, so that the order decides which definition wins.
    let mut items: Vec<String> = (0..3000).flat_map(|i| [service(i), slice(i)]).collect();
    items.push(service(7).replace("10.96.0.8", "10.96.9.9"));
    let text = list(&items);
    let before = RAW_READS.load(Ordering::Relaxed);
    let shown = both_ways(&text);
    // Read from their text (tests running alongside only add to the count).
    assert!(RAW_READS.load(Ordering::Relaxed) - before >= 6001);
    assert!(
        shown.contains("10.96.9.9") && !shown.contains("10.96.0.8,"),
        "{shown:.300}"
    );
    let loaded = load_text(Path::new("input.json"), &text).unwrap();
    assert_eq!(loaded.state.services.len(), 3000);
    assert_eq!(loaded.state.slices.len(), 3000);
    assert_eq!(loaded.replaced.len(), 1, "{:?}", loaded.replaced);
    // `items` before a kind that does not name a list: one object after all.
    let not_a_list = format!(
        "{{\"items\": [{}], \"apiVersion\": \"v1\", \"kind\": \"Service\", \"metadata\": {{\"namespace\": \"ns\", \"name\": \"odd\"}}, \"spec\": {{\"clusterIP\": \"10.96.1.1\", \"ports\": [{{\"port\": 80}}]}}}}\n{}",
        (0..300).map(service).collect::<Vec<_>>().join(","),
        list(&[service(400)])
    );
    let shown = both_ways(&not_a_list);
    let loaded = load_text(Path::new("input.json"), &not_a_list).unwrap();
    let names: Vec<String> = loaded
        .state
        .services
        .keys()
        .map(|n| n.name().to_owned())
        .collect();
    assert_eq!(names, ["odd", "s400"], "{shown:.300}");
}

#[test]
fn endpoints_share_their_localities_and_names_one_per_converting_thread() {
    // More slices than the queue holds, so that both threads convert some.
    let items: Vec<String> = (0..2000)
        .map(|i| {
            format!(
                r#"{{"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "metadata": {{"namespace": "ns", "name": "s{i}-x", "labels": {{"kubernetes.io/service-name": "s{i}"}}}}, "addressType": "IPv4", "endpoints": [{{"addresses": ["10.1.0.1"], "nodeName": "node-{}", "zone": "zone-{}"}}, {{"addresses": ["10.1.0.2"], "nodeName": "node-{}"}}], "ports": [{{"port": 8080}}]}}"#,
                i % 3,
                i % 2,
                (i + 1) % 3
            )
        })
        .collect();
    let loaded = load_text(Path::new("input.json"), &list(&items)).unwrap();
    assert_eq!(loaded.state.slices.len(), 2000);
    let mut texts: std::collections::BTreeMap<String, std::collections::BTreeSet<usize>> =
        Default::default();
    for slice in loaded.state.slices.values() {
        for ep in &slice.endpoints {
            let locality = ep.locality.as_ref().unwrap();
            let pair = format!("{:?}/{:?}", ep.node_name(), ep.zone());
            let at = std::sync::Arc::as_ptr(locality).addr();
            texts.entry(pair).or_default().insert(at);
            for name in locality.node_name.iter().chain(&locality.zone) {
                let at = std::sync::Arc::as_ptr(name).cast::<u8>().addr();
                texts.entry(name.to_string()).or_default().insert(at);
            }
        }
    }
    let names: Vec<&str> = texts.keys().map(String::as_str).collect();
    assert_eq!(
        names,
        [
            "Some(\"node-0\")/None",
            "Some(\"node-0\")/Some(\"zone-0\")",
            "Some(\"node-0\")/Some(\"zone-1\")",
            "Some(\"node-1\")/None",
            "Some(\"node-1\")/Some(\"zone-0\")",
            "Some(\"node-1\")/Some(\"zone-1\")",
            "Some(\"node-2\")/None",
            "Some(\"node-2\")/Some(\"zone-0\")",
            "Some(\"node-2\")/Some(\"zone-1\")",
            "node-0",
            "node-1",
            "node-2",
            "zone-0",
            "zone-1"
        ]
    );
    for (name, copies) in &texts {
        assert!(
            (1..=2).contains(&copies.len()),
            "{name}: {} copies",
            copies.len()
        );
    }
}

#[test]
fn the_threads_parts_merge_in_the_order_handed_out_with_take_backs_applied() {
    // Jobs 0..=7: this thread did 1 and 4 itself, took back to index 2 at 5 (dropping the
    // entries of jobs 2, 3 and 4), the other thread the rest.
    let own = vec![
        (1, Done::Entry("b")),
        (4, Done::Entry("e")),
        (5, Done::TakeBack(2)),
    ];
    let theirs = vec![(0, "a"), (2, "c"), (3, "d"), (6, "g"), (7, "h")];
    let merged: Vec<_> = in_file_order(own, theirs).into_iter().flatten().collect();
    assert_eq!(merged, ["a", "b", "g", "h"]);
    let merged: Vec<_> = in_file_order(vec![(0, Done::TakeBack(0))], vec![(1, "x")])
        .into_iter()
        .flatten()
        .collect();
    assert_eq!(merged, ["x"]);
    assert!(in_file_order::<&str>(Vec::new(), Vec::new()).is_empty());
}

#[test]
fn the_scan_finds_the_head_and_repeated_keys_and_leaves_escapes_to_values() {
    let svc = service(1);
    let scanned = |text: &str| {
        let mut keys = Vec::new();
        match scan(text, &mut keys) {
            Scan::Clean(head) => format!(
                "clean {:?} {:?}",
                head.kind(),
                head.name(false).unwrap_or_default()
            ),
            Scan::Repeated => "repeated".to_string(),
            Scan::Unsure => "unsure".to_string(),
        }
    };
    assert_eq!(scanned(&svc), "clean Some(Service) \"ns/s1\"");
    assert_eq!(scanned(&slice(2)), "clean Some(EndpointSlice) \"ns/s2-x\"");
    // Only the item's own kind and metadata count, not a nested object's.
    let nested = svc.replacen(
        "\"spec\": {",
        "\"spec\": {\"kind\": \"Node\", \"metadata\": {\"name\": \"n\"}, ",
        1,
    );
    assert_eq!(scanned(&nested), "clean Some(Service) \"ns/s1\"");
    let in_array = svc.replacen("\"spec\": {", "\"x\": [{\"name\": \"n\"}], \"spec\": {", 1);
    assert_eq!(scanned(&in_array), "clean Some(Service) \"ns/s1\"");
    let metadata_string = svc.replacen("\"metadata\": {", "\"metadata\": \"m\", \"x\": {", 1);
    assert_eq!(scanned(&metadata_string), "clean Some(Service) \"\"");
    assert_eq!(
        scanned(&svc.replacen("\"v1\"", "\"v2\"", 1)),
        "clean None \"ns/s1\""
    );
    // Escapes that do not matter, and a quote escaped inside a value.
    let escaped_value = svc.replacen("\"1\"", "\"\\n\\\"\\u00e9\"", 1);
    assert_eq!(scanned(&escaped_value), "clean Some(Service) \"ns/s1\"");
    let literals = svc.replacen(
        "\"port\": 80",
        "\"port\": 80, \"x\": [true, false, null, -0.5]",
        1,
    );
    assert_eq!(scanned(&literals), "clean Some(Service) \"ns/s1\"");
    for repeated in [
        svc.replacen("\"a\": \"1\"", "\"a\": \"1\", \"a\": \"1\"", 1),
        svc.replacen("\"port\": 80", "\"port\": 80, \"port\": 80", 1),
        svc.replacen(
            "\"kind\": \"Service\"",
            "\"kind\": \"Service\", \"kind\": 1",
            1,
        ),
    ] {
        assert_eq!(scanned(&repeated), "repeated", "{repeated}");
    }
    for unsure in [
        svc.replacen("\"kind\"", "\"k\\u0069nd\"", 1),
        svc.replacen("\"s1\"", "\"s\\u0031\"", 1),
        svc.replacen("\"1\"", "\"\\uD800\"", 1),
        svc.replacen("\"1\"", "\"\\udfff\"", 1),
        format!(
            "{}1{}",
            "[".repeat(MAX_DEPTH + 1),
            "]".repeat(MAX_DEPTH + 1)
        ),
        svc.replacen("\"port\": 80", "\"port\": 8e1", 1),
        svc.replacen("\"port\": 80", "\"port\": 0.8E+2", 1),
        svc.replacen("\"port\": 80", &format!("\"port\": {}", "1".repeat(65)), 1),
    ] {
        assert_eq!(scanned(&unsure), "unsure", "{unsure}");
    }
    // A mapping with many keys, one of them twice, far apart.
    let many: Vec<String> = (0..5000).map(|i| format!("\"k{i}\": {i}")).collect();
    let text = format!("{{{}, \"k17\": 0}}", many.join(", "));
    assert_eq!(scanned(&text), "repeated");
    assert_eq!(
        scanned(&format!("{{{}}}", many.join(", "))),
        "clean None \"\""
    );
}

#[test]
fn the_end_of_a_string_is_found_wherever_it_falls_in_a_word() {
    for len in 0..24 {
        for at in 0..len {
            for c in [b'"', b'\\'] {
                // Bytes just above and below the ones looked for, and UTF-8's high bytes.
                let mut text: Vec<u8> = (0..len)
                    .map(|i| [b'!', b'#', b'[', b']', 0xc3, 0xa9][i % 6])
                    .collect();
                text[at] = c;
                for from in 0..=at {
                    assert_eq!(
                        quote_or_backslash(&text, from),
                        Some(at),
                        "{text:?} from {from}"
                    );
                }
                if at + 1 < len {
                    text[at + 1] = b'"';
                    assert_eq!(quote_or_backslash(&text, at + 1), Some(at + 1), "{text:?}");
                }
            }
        }
        let none: Vec<u8> = (0..len)
            .map(|i| [b'!', b'#', b'[', b']', 0xc3, 0xa9][i % 6])
            .collect();
        assert_eq!(quote_or_backslash(&none, 0), None, "{none:?}");
    }
}

/// An EndpointSlice with every field k8s-openapi knows written, each endpoint's too.
fn full_slice() -> Value {
    serde_json::json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "namespace": "ns", "name": "web-x", "uid": "u-1", "resourceVersion": "7",
            "creationTimestamp": "2026-11-27T10:00:00Z",
            "labels": {"kubernetes.io/service-name": "web"},
            "annotations": {"a": "b"},
            "ownerReferences": [{"apiVersion": "v1", "kind": "Service", "name": "web", "uid": "u-0"}]
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "protocol": "TCP", "port": 8080, "appProtocol": "http"}],
        "endpoints": [
            {
                "addresses": ["10.1.0.1", "10.1.0.2"],
                "conditions": {"ready": true, "serving": true, "terminating": false},
                "deprecatedTopology": {"k": "v"},
                "hints": {"forZones": [{"name": "z1"}], "forNodes": [{"name": "node-a"}]},
                "hostname": "web-0",
                "nodeName": "node-a",
                "targetRef": {"kind": "Pod", "namespace": "ns", "name": "web-0", "uid": "u-2"},
                "zone": "z1"
            },
            {"addresses": ["10.1.0.3"], "nodeName": "node-b", "zone": "z\u{e9}"}
        ]
    })
}

/// The slice decoding of [`slice`] against k8s-openapi's on `text`: it decodes exactly what
/// k8s-openapi decodes, and that converts to the same model object, dropped endpoints and
/// rejection. Returns whether it decoded.
fn slice_decodes_as_k8s_openapi(text: &str) -> bool {
    let k8s = serde_json::from_str::<discovery::EndpointSlice>(text);
    let Some(borrowed) = slice::decode(text) else {
        assert!(k8s.is_err(), "decoded by k8s-openapi, not here: {text}");
        return false;
    };
    let k8s = k8s.unwrap_or_else(|e| panic!("decoded here, refused by k8s-openapi ({e}): {text}"));
    let (mut dropped_k8s, mut dropped) = (Vec::new(), Vec::new());
    assert_eq!(
        format!(
            "{:?}",
            convert::endpoint_slice_noting(&k8s, &mut dropped_k8s, &mut NameTable::default())
        ),
        format!(
            "{:?}",
            convert::endpoint_slice_noting(&borrowed, &mut dropped, &mut NameTable::default())
        ),
        "{text}"
    );
    assert_eq!(format!("{dropped_k8s:?}"), format!("{dropped:?}"), "{text}");
    assert_eq!(
        convert::ignored_slice_reason(&k8s),
        convert::ignored_slice_reason(&borrowed)
    );
    true
}

/// The keys of the mapping at JSON pointer `at` in `v`, sorted.
fn keys_at(v: &Value, at: &str) -> Vec<String> {
    let mut keys: Vec<String> = v
        .pointer(at)
        .unwrap()
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .collect();
    keys.sort();
    keys
}

#[test]
fn a_slice_decoded_with_borrowed_strings_reads_as_k8s_openapi_reads_it_whatever_a_field_holds() {
    let full = full_slice();
    assert!(slice_decodes_as_k8s_openapi(&full.to_string()));
    // Every field k8s-openapi reads, of the slice and of an endpoint, replaced by values of
    // every JSON type and removed: a field k8s-openapi gains in a later version is decoded by
    // it and skipped here, and fails this test on the values it refuses.
    let others = [
        Value::Null,
        serde_json::json!(true),
        serde_json::json!(7),
        serde_json::json!(-1.5),
        serde_json::json!("x"),
        serde_json::json!("10.1.0.9"),
        serde_json::json!([]),
        serde_json::json!(["10.1.0.9"]),
        serde_json::json!([7]),
        serde_json::json!({}),
        serde_json::json!({"ready": false}),
    ];
    // The slice's own fields, and those of its first endpoint (JSON pointers).
    let objects = ["", "/endpoints/0"];
    let mut decoded = 0;
    let mut variants = 0;
    for at in objects {
        for key in keys_at(&full, at) {
            for other in others.iter().map(Some).chain([None]) {
                let mut v = full.clone();
                let object = v.pointer_mut(at).unwrap().as_object_mut().unwrap();
                match other {
                    Some(o) => drop(object.insert(key.clone(), o.clone())),
                    None => drop(object.remove(&key)),
                }
                variants += 1;
                decoded += usize::from(slice_decodes_as_k8s_openapi(&v.to_string()));
            }
        }
    }
    // k8s-openapi's own fields are all written in the full slice: serialized back, it has
    // the same keys (a field added to k8s-openapi's type, with a value, shows up here).
    let k8s: discovery::EndpointSlice = serde_json::from_value(full.clone()).unwrap();
    let back = serde_json::to_value(&k8s).unwrap();
    for at in objects {
        assert_eq!(keys_at(&back, at), keys_at(&full, at), "at {at:?}");
    }
    // Both kinds of variant occur: accepted ones compared by their conversion, refused ones.
    assert!(
        decoded >= 40 && variants - decoded >= 40,
        "{decoded} of {variants} decoded"
    );
    // Items of a list, whole and in parts.
    let mut endpoint_array = full.clone();
    endpoint_array["endpoints"] = serde_json::json!([["10.1.0.1"]]);
    for text in [
        full.to_string(),
        endpoint_array.to_string(),
        full.to_string().replace("\"node-a\"", "\"node\\u002da\""),
        full.to_string()
            .replace("\"10.1.0.1\"", "\"10.1.0.\\u0031\""),
    ] {
        slice_decodes_as_k8s_openapi(&text);
        both_ways(&list(&[text]));
    }
    assert!(!slice_decodes_as_k8s_openapi(&endpoint_array.to_string()));
}
