//! A fake Kubernetes API server for the watch tests: list and watch of Services, EndpointSlices
//! and Nodes over plain HTTP/1.1 on 127.0.0.1, with controls for the failures the API source must
//! survive (410 Gone, dropped and silently dead connections, an API server that is down), and
//! creation and merge-patching of events.k8s.io/v1 Events, kept for the tests to read.
//!
//! Hand-written on tokio rather than a web framework: the protocol subset is small (GET, one
//! request per connection, `Content-Length` lists, chunked watch streams), and the failure modes
//! we need (a connection that stays open but never answers, refusing connections) are easier to
//! produce at the socket level than through a framework.
//!
//! What it implements, as the real API server does it:
//! - a global resourceVersion bumped by every change; lists return it in `metadata`;
//! - `limit` pages a list: each page carries `metadata.continue` until the last, and every page
//!   comes from the snapshot taken by the first, with its resourceVersion (as the real server
//!   serves a paginated list at one etcd revision); the watcher asks for 500 per page;
//! - watches from a resourceVersion replay the history after it, then stream new changes; a
//!   resourceVersion older than the compacted history gets an `ERROR` event with code 410;
//! - label selectors (`k`, `!k`, `k=v`, `k!=v`) and field selectors on `metadata.name` /
//!   `metadata.namespace`; an object that stops matching is sent as `DELETED`;
//! - `timeoutSeconds` ends a watch cleanly; `allowWatchBookmarks` enables `BOOKMARK` events;
//! - `POST /apis/events.k8s.io/v1/namespaces/{ns}/events` creates an Event (its name given, or
//!   generated from `generateName`; 409 if it exists) and `PATCH …/events/{name}` merge-patches
//!   one (404 if absent); both answer with the stored object, which gets a resourceVersion from
//!   the global counter, a uid and a creationTimestamp, as the real server does.

#![allow(dead_code)] // Each test crate uses a different part of the controls.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// The kinds the fake serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    Service,
    EndpointSlice,
    Node,
    ServiceCidr,
}

impl Kind {
    fn from_path(path: &str) -> Option<Kind> {
        match path {
            "/api/v1/services" => Some(Kind::Service),
            "/apis/discovery.k8s.io/v1/endpointslices" => Some(Kind::EndpointSlice),
            "/api/v1/nodes" => Some(Kind::Node),
            "/apis/networking.k8s.io/v1/servicecidrs" => Some(Kind::ServiceCidr),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Kind::Service => "Service",
            Kind::EndpointSlice => "EndpointSlice",
            Kind::Node => "Node",
            Kind::ServiceCidr => "ServiceCIDR",
        }
    }

    fn api_version(self) -> &'static str {
        match self {
            Kind::EndpointSlice => "discovery.k8s.io/v1",
            Kind::ServiceCidr => "networking.k8s.io/v1",
            Kind::Service | Kind::Node => "v1",
        }
    }
}

/// One change in the history that watches replay and stream.
#[derive(Debug, Clone)]
enum Entry {
    Change {
        rv: u64,
        kind: Kind,
        old: Option<Value>,
        new: Option<Value>,
    },
    /// A `BOOKMARK` to every open watch that allows bookmarks.
    Bookmark,
    /// An `ERROR` 410 to every open watch, which then ends.
    Expire,
}

#[derive(Default)]
struct Inner {
    rv: u64,
    objects: BTreeMap<(Kind, String, String), Value>,
    log: Vec<Entry>,
    /// Watches from a resourceVersion below this get 410.
    compacted: u64,
    /// Bumped by `silence_watches`: watches started before go silent.
    silence_epoch: u64,
    /// Kinds whose lists (and watches) wait until released.
    held: BTreeSet<Kind>,
    /// Kinds whose list pages after the first wait until released.
    held_pages: BTreeSet<Kind>,
    /// Kinds the server does not have (404), as an older API server lacks ServiceCIDR.
    missing: BTreeSet<Kind>,
    /// Every request line received (`GET /path?query`).
    requests: Vec<String>,
    /// Bookmarks written, by kind.
    bookmarks_sent: BTreeMap<Kind, usize>,
    /// Watches being served (silenced ones included), by kind.
    open_watches: BTreeMap<Kind, usize>,
    /// Events as stored, by namespace and name.
    events: BTreeMap<(String, String), Value>,
    /// Every Event write accepted, in order: the method and the object as stored after it.
    event_writes: Vec<(String, Value)>,
    /// Paginated lists in progress: the first page's resourceVersion and the items it saw,
    /// by continue token's list number.
    lists: BTreeMap<u64, (u64, Vec<Value>)>,
    /// Numbers the paginated lists.
    next_list: u64,
}

/// Counts a watch as open while it lives.
struct OpenWatch {
    shared: Arc<Shared>,
    kind: Kind,
}

impl Drop for OpenWatch {
    fn drop(&mut self) {
        if let Ok(mut inner) = self.shared.inner.lock()
            && let Some(n) = inner.open_watches.get_mut(&self.kind)
        {
            *n -= 1;
        }
    }
}

struct Shared {
    inner: Mutex<Inner>,
    /// Bumped on every control action; open watches re-check `inner` when it changes.
    tick: watch::Sender<u64>,
    connections: Mutex<Vec<JoinHandle<()>>>,
}

impl Shared {
    fn wake(&self) {
        self.tick.send_modify(|t| *t += 1);
    }
}

/// The fake API server. Dropping it stops it and removes its kubeconfig.
pub struct FakeApi {
    shared: Arc<Shared>,
    port: u16,
    accept: Mutex<Option<JoinHandle<()>>>,
    kubeconfig: PathBuf,
}

impl Drop for FakeApi {
    fn drop(&mut self) {
        if let Some(a) = self.accept.lock().unwrap().take() {
            a.abort();
        }
        for c in self.shared.connections.lock().unwrap().drain(..) {
            c.abort();
        }
        let _ = std::fs::remove_file(&self.kubeconfig);
    }
}

impl FakeApi {
    /// Starts the server on a free port of 127.0.0.1 and writes a kubeconfig pointing at it.
    pub async fn start() -> FakeApi {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let shared = Arc::new(Shared {
            inner: Mutex::new(Inner {
                rv: 100,
                compacted: 0,
                ..Inner::default()
            }),
            tick: watch::channel(0).0,
            connections: Mutex::new(Vec::new()),
        });
        let kubeconfig = std::env::temp_dir().join(format!(
            "nodeproxy-fakeapi-{}-{port}.yaml",
            std::process::id()
        ));
        // kube-client builds a TLS configuration even for an http:// server, and without a CA in
        // the kubeconfig it loads the system's CA store, which a minimal CI image may lack. A CA
        // that is never used (the server is plain http) avoids that dependency.
        let ca = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fakeapi/dummy-ca.pem");
        std::fs::write(
            &kubeconfig,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: http://127.0.0.1:{port}\n    certificate-authority: {ca}\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\ncurrent-context: fake\nusers:\n- name: fake\n  user: {{}}\n"
            ),
        )
        .unwrap();
        let api = FakeApi {
            shared,
            port,
            accept: Mutex::new(None),
            kubeconfig,
        };
        api.serve(listener);
        api
    }

    fn serve(&self, listener: TcpListener) {
        let shared = self.shared.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let conn = tokio::spawn(handle(stream, shared.clone()));
                let mut conns = shared.connections.lock().unwrap();
                conns.retain(|c| !c.is_finished());
                conns.push(conn);
            }
        });
        *self.accept.lock().unwrap() = Some(task);
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// A kubeconfig whose server is this fake.
    pub fn kubeconfig(&self) -> &std::path::Path {
        &self.kubeconfig
    }

    /// Adds or replaces an object; returns its new resourceVersion.
    pub fn apply(&self, kind: Kind, mut obj: Value) -> u64 {
        let rv = {
            let mut inner = self.shared.inner.lock().unwrap();
            inner.rv += 1;
            let rv = inner.rv;
            obj["apiVersion"] = kind.api_version().into();
            obj["kind"] = kind.name().into();
            obj["metadata"]["resourceVersion"] = rv.to_string().into();
            let key = object_key(kind, &obj);
            let old = inner.objects.insert(key, obj.clone());
            inner.log.push(Entry::Change {
                rv,
                kind,
                old,
                new: Some(obj),
            });
            rv
        };
        self.shared.wake();
        rv
    }

    /// Deletes an object (namespace "" for Nodes). Returns false if it did not exist.
    pub fn delete(&self, kind: Kind, namespace: &str, name: &str) -> bool {
        let found = {
            let mut inner = self.shared.inner.lock().unwrap();
            let key = (kind, namespace.to_owned(), name.to_owned());
            match inner.objects.remove(&key) {
                None => false,
                Some(old) => {
                    inner.rv += 1;
                    let rv = inner.rv;
                    inner.log.push(Entry::Change {
                        rv,
                        kind,
                        old: Some(old),
                        new: None,
                    });
                    true
                }
            }
        };
        self.shared.wake();
        found
    }

    /// How many bookmarks were written to watches of `kind`.
    pub fn bookmarks_sent(&self, kind: Kind) -> usize {
        self.shared
            .inner
            .lock()
            .unwrap()
            .bookmarks_sent
            .get(&kind)
            .copied()
            .unwrap_or(0)
    }

    /// Sends a `BOOKMARK` with the current resourceVersion to every open watch (a watch between
    /// two requests misses it, as with a real API server).
    pub fn bookmark(&self) {
        self.shared.inner.lock().unwrap().log.push(Entry::Bookmark);
        self.shared.wake();
    }

    /// Forgets the history: a watch resuming from an older resourceVersion gets 410.
    pub fn compact(&self) {
        let mut inner = self.shared.inner.lock().unwrap();
        inner.compacted = inner.rv;
    }

    /// Sends `ERROR` 410 "too old resource version" to every open watch, and makes every
    /// resourceVersion seen so far too old (a watch between two requests gets 410 when it
    /// resumes), forcing the clients to relist.
    pub fn expire_watches(&self) {
        {
            let mut inner = self.shared.inner.lock().unwrap();
            // Move on one version, as real history does, so that a fresh list is resumable.
            inner.rv += 1;
            inner.compacted = inner.rv;
            inner.log.push(Entry::Expire);
        }
        self.shared.wake();
    }

    /// Closes every open connection at once.
    pub fn drop_connections(&self) {
        for c in self.shared.connections.lock().unwrap().drain(..) {
            c.abort();
        }
    }

    /// The API server goes away: open connections close and new ones are refused (the port is
    /// no longer listened on).
    pub fn go_down(&self) {
        if let Some(a) = self.accept.lock().unwrap().take() {
            a.abort();
        }
        self.drop_connections();
    }

    /// The API server comes back on the same port.
    pub async fn come_back(&self) {
        // The aborted accept task releases the port when it is dropped, which happens on the
        // runtime shortly after `abort`; retry briefly.
        for _ in 0..100 {
            if let Ok(listener) = TcpListener::bind(("127.0.0.1", self.port)).await {
                self.serve(listener);
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("port {} could not be bound again", self.port);
    }

    /// Every watch open now stops sending anything, forever, while keeping its connection open
    /// and ignoring what the client sends: a half-open connection as seen from the client.
    /// Watches started later behave normally. Returns how many watches of each kind were open
    /// (and so are now dead).
    pub fn silence_watches(&self) -> BTreeMap<Kind, usize> {
        let open = {
            let mut inner = self.shared.inner.lock().unwrap();
            inner.silence_epoch += 1;
            inner.open_watches.clone()
        };
        self.shared.wake();
        open
    }

    /// Serves 404 for `kind` from now on, as an API server without that resource does.
    pub fn remove_resource(&self, kind: Kind) {
        self.shared.inner.lock().unwrap().missing.insert(kind);
    }

    /// Lists and watches of `kind` wait until [`FakeApi::release`].
    pub fn hold(&self, kind: Kind) {
        self.shared.inner.lock().unwrap().held.insert(kind);
    }

    pub fn release(&self, kind: Kind) {
        self.shared.inner.lock().unwrap().held.remove(&kind);
        self.shared.wake();
    }

    /// Holds the pages after the first of every list of `kind` until `release_pages`.
    pub fn hold_pages(&self, kind: Kind) {
        self.shared.inner.lock().unwrap().held_pages.insert(kind);
    }

    pub fn release_pages(&self, kind: Kind) {
        self.shared.inner.lock().unwrap().held_pages.remove(&kind);
        self.shared.wake();
    }

    /// Request lines received so far, e.g. `GET /api/v1/services?labelSelector=...`.
    pub fn requests(&self) -> Vec<String> {
        self.shared.inner.lock().unwrap().requests.clone()
    }

    /// The Events stored now (each as its last write left it), ordered by namespace and name.
    pub fn events(&self) -> Vec<Value> {
        self.shared
            .inner
            .lock()
            .unwrap()
            .events
            .values()
            .cloned()
            .collect()
    }

    /// Every Event write accepted (`POST` or `PATCH`), in order, with the object as stored
    /// after it.
    pub fn event_writes(&self) -> Vec<(String, Value)> {
        self.shared.inner.lock().unwrap().event_writes.clone()
    }

    /// How many list (`watch == false`) or watch requests of `kind` were received.
    pub fn count(&self, kind: Kind, watch: bool) -> usize {
        let inner = self.shared.inner.lock().unwrap();
        inner
            .requests
            .iter()
            .filter(|r| {
                let (path, query) = split_target(r.trim_start_matches("GET "));
                Kind::from_path(path) == Some(kind) && query_has_watch(query) == watch
            })
            .count()
    }
}

fn object_key(kind: Kind, obj: &Value) -> (Kind, String, String) {
    let meta = &obj["metadata"];
    (
        kind,
        meta["namespace"].as_str().unwrap_or_default().to_owned(),
        meta["name"].as_str().unwrap_or_default().to_owned(),
    )
}

fn split_target(target: &str) -> (&str, &str) {
    target.split_once('?').unwrap_or((target, ""))
}

fn query_has_watch(query: &str) -> bool {
    parse_query(query).get("watch").map(String::as_str) == Some("true")
}

fn parse_query(query: &str) -> BTreeMap<String, String> {
    query
        .split('&')
        .filter(|kv| !kv.is_empty())
        .map(|kv| {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("");
                match u8::from_str_radix(hex, 16) {
                    Ok(b) => {
                        out.push(b);
                        i += 3;
                        continue;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            b'+' => out.push(b' '),
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Whether `obj` matches the request's label and field selectors.
fn matches(obj: &Value, params: &BTreeMap<String, String>) -> bool {
    let labels = obj["metadata"]["labels"].as_object();
    let label = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
    let labels_ok = params.get("labelSelector").is_none_or(|sel| {
        sel.split(',').filter(|t| !t.is_empty()).all(|term| {
            if let Some(k) = term.strip_prefix('!') {
                label(k).is_none()
            } else if let Some((k, v)) = term.split_once("!=") {
                label(k) != Some(v)
            } else if let Some((k, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
                label(k) == Some(v)
            } else {
                label(term).is_some()
            }
        })
    });
    let fields_ok = params.get("fieldSelector").is_none_or(|sel| {
        sel.split(',').filter(|t| !t.is_empty()).all(|term| {
            let Some((field, value)) = term.split_once('=') else {
                return false;
            };
            let actual = match field {
                "metadata.name" => obj["metadata"]["name"].as_str(),
                "metadata.namespace" => obj["metadata"]["namespace"].as_str(),
                _ => None,
            };
            actual.unwrap_or_default() == value
        })
    });
    labels_ok && fields_ok
}

/// Serves one connection: one request, then close.
async fn handle(mut stream: TcpStream, shared: Arc<Shared>) {
    let Some((method, target, body)) = read_request(&mut stream).await else {
        return;
    };
    // Every request is recorded with its method, those the fake does not serve too: the
    // manifest test checks each against the packaged ClusterRole.
    shared
        .inner
        .lock()
        .unwrap()
        .requests
        .push(format!("{method} {target}"));
    if let Some(event) = event_target(&target) {
        let (status, body) = write_event(&shared, &method, event, &body);
        respond(&mut stream, status, &body).await;
        return;
    }
    if method != "GET" {
        let body = json!({"apiVersion": "v1", "kind": "Status", "status": "Failure",
            "message": format!("the fake API server serves only GET, not {method}"), "reason": "MethodNotAllowed", "code": 405});
        respond(&mut stream, "405 Method Not Allowed", &body).await;
        return;
    }
    let (path, query) = split_target(&target);
    let missing = |k: &Kind| shared.inner.lock().unwrap().missing.contains(k);
    let Some(kind) = Kind::from_path(path).filter(|k| !missing(k)) else {
        let body = json!({"apiVersion": "v1", "kind": "Status", "status": "Failure",
            "message": format!("the fake API server does not serve {path}"), "reason": "NotFound", "code": 404});
        respond(&mut stream, "404 Not Found", &body).await;
        return;
    };
    let params = parse_query(query);

    let mut tick = shared.tick.subscribe();
    let next_page = params.get("continue").is_some_and(|c| !c.is_empty());
    let held = |inner: &Inner| {
        inner.held.contains(&kind) || (next_page && inner.held_pages.contains(&kind))
    };
    while held(&shared.inner.lock().unwrap()) {
        if tick.changed().await.is_err() {
            return;
        }
    }

    if params.get("watch").map(String::as_str) == Some("true") {
        serve_watch(stream, kind, &params, shared, tick).await;
    } else {
        let body = match list_page(&shared, kind, &params) {
            Ok(body) => body,
            Err(message) => {
                let body = json!({"apiVersion": "v1", "kind": "Status", "status": "Failure",
                    "message": message, "reason": "BadRequest", "code": 400});
                respond(&mut stream, "400 Bad Request", &body).await;
                return;
            }
        };
        respond(&mut stream, "200 OK", &body).await;
    }
}

/// One page of a list: everything without `limit`; with it, at most `limit` items and a
/// `continue` token while more remain, every page from the first page's snapshot.
fn list_page(
    shared: &Shared,
    kind: Kind,
    params: &BTreeMap<String, String>,
) -> Result<Value, String> {
    let mut inner = shared.inner.lock().unwrap();
    let limit = match params.get("limit").map(|l| l.parse::<usize>()) {
        None | Some(Ok(0)) => None,
        Some(Ok(n)) => Some(n),
        Some(Err(_)) => return Err(format!("limit {:?} is not a number", params["limit"])),
    };
    let (list, offset) = match params.get("continue").filter(|c| !c.is_empty()) {
        Some(token) => {
            let parsed = token
                .split_once(':')
                .and_then(|(l, o)| Some((l.parse::<u64>().ok()?, o.parse::<usize>().ok()?)));
            match parsed {
                Some((list, offset)) if inner.lists.contains_key(&list) => (list, offset),
                _ => {
                    return Err(format!(
                        "continue token {token:?} is not one this server gave"
                    ));
                }
            }
        }
        None => {
            let items: Vec<Value> = inner
                .objects
                .iter()
                .filter(|((k, _, _), obj)| *k == kind && matches(obj, params))
                .map(|(_, obj)| obj.clone())
                .collect();
            let list = inner.next_list;
            inner.next_list += 1;
            let rv = inner.rv;
            inner.lists.insert(list, (rv, items));
            (list, 0)
        }
    };
    let (rv, items) = &inner.lists[&list];
    let rv = *rv;
    let end = limit.map_or(items.len(), |n| items.len().min(offset.saturating_add(n)));
    let page: Vec<Value> = items.get(offset..end).unwrap_or_default().to_vec();
    let more = end < items.len();
    if !more {
        inner.lists.remove(&list);
    }
    let mut metadata = json!({"resourceVersion": rv.to_string()});
    if more {
        metadata["continue"] = format!("{list}:{end}").into();
    }
    Ok(json!({
        "apiVersion": kind.api_version(),
        "kind": format!("{}List", kind.name()),
        "metadata": metadata,
        "items": page,
    }))
}

/// Reads the request; returns its method, target and body (as long as `Content-Length` says).
async fn read_request(stream: &mut TcpStream) -> Option<(String, String, Vec<u8>)> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = stream.read(&mut chunk).await.ok()?;
        if n == 0 || buf.len() > 64 * 1024 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let length: usize = head
        .lines()
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.trim().parse().ok())
        .unwrap_or(0);
    while buf.len() < head_end + length {
        let n = stream.read(&mut chunk).await.ok()?;
        if n == 0 || buf.len() > 1024 * 1024 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let line = head.lines().next()?;
    let mut parts = line.split(' ');
    let method = parts.next()?.to_owned();
    let target = parts.next()?.to_owned();
    Some((method, target, buf[head_end..head_end + length].to_vec()))
}

/// An events.k8s.io Event request's namespace and, for a named one, the Event's name.
fn event_target(target: &str) -> Option<(String, Option<String>)> {
    let (path, _) = split_target(target);
    let rest = path.strip_prefix("/apis/events.k8s.io/v1/namespaces/")?;
    let parts: Vec<&str> = rest.split('/').collect();
    match parts.as_slice() {
        [ns, "events"] => Some(((*ns).to_owned(), None)),
        [ns, "events", name] => Some(((*ns).to_owned(), Some((*name).to_owned()))),
        _ => None,
    }
}

fn status(code: u16, reason: &str, message: String) -> Value {
    json!({"apiVersion": "v1", "kind": "Status", "status": "Failure",
           "message": message, "reason": reason, "code": code})
}

/// Creates (`POST`) or merge-patches (`PATCH`) an Event; returns the HTTP status and body.
fn write_event(
    shared: &Shared,
    method: &str,
    (namespace, name): (String, Option<String>),
    body: &[u8],
) -> (&'static str, Value) {
    let Ok(sent) = serde_json::from_slice::<Value>(body) else {
        return (
            "400 Bad Request",
            status(400, "BadRequest", "the body is not JSON".into()),
        );
    };
    let mut inner = shared.inner.lock().unwrap();
    inner.rv += 1;
    let rv = inner.rv;
    let stored = match (method, name) {
        ("POST", None) => {
            let mut obj = sent;
            let name = match obj["metadata"]["name"].as_str() {
                Some(n) if !n.is_empty() => n.to_owned(),
                _ => match obj["metadata"]["generateName"].as_str() {
                    Some(prefix) => format!("{prefix}{rv:05x}"),
                    None => {
                        return (
                            "422 Unprocessable Entity",
                            status(422, "Invalid", "name or generateName is required".into()),
                        );
                    }
                },
            };
            let key = (namespace.clone(), name.clone());
            if inner.events.contains_key(&key) {
                return (
                    "409 Conflict",
                    status(
                        409,
                        "AlreadyExists",
                        format!("events \"{name}\" already exists"),
                    ),
                );
            }
            obj["apiVersion"] = "events.k8s.io/v1".into();
            obj["kind"] = "Event".into();
            obj["metadata"]["name"] = name.into();
            obj["metadata"]["namespace"] = namespace.into();
            obj["metadata"]["uid"] = format!("fake-event-uid-{rv}").into();
            obj["metadata"]["creationTimestamp"] = "2026-01-01T00:00:00Z".into();
            obj["metadata"]["resourceVersion"] = rv.to_string().into();
            inner.events.insert(key, obj.clone());
            obj
        }
        ("PATCH", Some(name)) => {
            let Some(obj) = inner.events.get_mut(&(namespace, name.clone())) else {
                return (
                    "404 Not Found",
                    status(404, "NotFound", format!("events \"{name}\" not found")),
                );
            };
            merge_patch(obj, &sent);
            obj["metadata"]["resourceVersion"] = rv.to_string().into();
            obj.clone()
        }
        _ => {
            return (
                "405 Method Not Allowed",
                status(
                    405,
                    "MethodNotAllowed",
                    format!("the fake API server does not serve {method} of this Event path"),
                ),
            );
        }
    };
    inner.event_writes.push((method.to_owned(), stored.clone()));
    let code = if method == "POST" {
        "201 Created"
    } else {
        "200 OK"
    };
    (code, stored)
}

/// RFC 7386 JSON merge patch: objects merge key by key, `null` deletes, anything else replaces.
fn merge_patch(target: &mut Value, patch: &Value) {
    let Value::Object(fields) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = json!({});
    }
    let obj = target.as_object_mut().unwrap();
    for (k, v) in fields {
        if v.is_null() {
            obj.remove(k);
        } else {
            merge_patch(obj.entry(k.clone()).or_insert(Value::Null), v);
        }
    }
}

async fn respond(stream: &mut TcpStream, status: &str, body: &Value) {
    let body = body.to_string();
    let msg = format!(
        "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = stream.write_all(msg.as_bytes()).await;
    let _ = stream.shutdown().await;
}

async fn write_chunk(stream: &mut TcpStream, event: &Value) -> std::io::Result<()> {
    let mut line = event.to_string();
    line.push('\n');
    stream
        .write_all(format!("{:x}\r\n{line}\r\n", line.len()).as_bytes())
        .await?;
    stream.flush().await
}

fn expired(requested: u64, current: u64) -> Value {
    json!({"type": "ERROR", "object": {
        "apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
        "message": format!("too old resource version: {requested} ({current})"),
        "reason": "Expired", "code": 410}})
}

/// Streams a watch until its `timeoutSeconds`, a 410, or the connection is dropped.
async fn serve_watch(
    mut stream: TcpStream,
    kind: Kind,
    params: &BTreeMap<String, String>,
    shared: Arc<Shared>,
    mut tick: watch::Receiver<u64>,
) {
    let head = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n";
    if stream.write_all(head.as_bytes()).await.is_err() {
        return;
    }
    let bookmarks = params.get("allowWatchBookmarks").map(String::as_str) == Some("true");
    let deadline = params
        .get("timeoutSeconds")
        .and_then(|t| t.parse::<u64>().ok())
        .map(|t| tokio::time::Instant::now() + Duration::from_secs(t));

    // The history after the requested resourceVersion, then everything logged from now on.
    let start = {
        let mut inner = shared.inner.lock().unwrap();
        let requested = params
            .get("resourceVersion")
            .and_then(|rv| rv.parse::<u64>().ok())
            .unwrap_or(inner.rv);
        if requested < inner.compacted {
            Err(expired(requested, inner.rv))
        } else {
            let backlog: Vec<Entry> = inner
                .log
                .iter()
                .filter(|e| matches!(e, Entry::Change { rv, .. } if *rv > requested))
                .cloned()
                .collect();
            *inner.open_watches.entry(kind).or_default() += 1;
            Ok((backlog, inner.log.len(), inner.silence_epoch))
        }
    };
    let (mut pending, mut cursor, epoch) = match start {
        Ok(start) => start,
        Err(event) => {
            let _ = write_chunk(&mut stream, &event).await;
            let _ = stream.write_all(b"0\r\n\r\n").await;
            return;
        }
    };
    let _open = OpenWatch {
        shared: shared.clone(),
        kind,
    };

    loop {
        for entry in pending.drain(..) {
            let event = match entry {
                Entry::Change {
                    rv,
                    kind: k,
                    old,
                    new,
                } => {
                    if k != kind {
                        continue;
                    }
                    let was = old.as_ref().is_some_and(|o| matches(o, params));
                    let is = new.as_ref().is_some_and(|n| matches(n, params));
                    match (was, is, new, old) {
                        (false, true, Some(n), _) => json!({"type": "ADDED", "object": n}),
                        (true, true, Some(n), _) => json!({"type": "MODIFIED", "object": n}),
                        (true, false, Some(n), _) => json!({"type": "DELETED", "object": n}),
                        (true, false, None, Some(mut o)) => {
                            o["metadata"]["resourceVersion"] = rv.to_string().into();
                            json!({"type": "DELETED", "object": o})
                        }
                        _ => continue,
                    }
                }
                Entry::Bookmark if bookmarks => {
                    let rv = {
                        let mut inner = shared.inner.lock().unwrap();
                        *inner.bookmarks_sent.entry(kind).or_default() += 1;
                        inner.rv
                    };
                    json!({"type": "BOOKMARK", "object": {
                        "apiVersion": kind.api_version(), "kind": kind.name(),
                        "metadata": {"resourceVersion": rv.to_string()}}})
                }
                Entry::Bookmark => continue,
                Entry::Expire => {
                    let (compacted, rv) = {
                        let inner = shared.inner.lock().unwrap();
                        (inner.compacted, inner.rv)
                    };
                    let _ = write_chunk(&mut stream, &expired(compacted, rv)).await;
                    let _ = stream.write_all(b"0\r\n\r\n").await;
                    return;
                }
            };
            if write_chunk(&mut stream, &event).await.is_err() {
                return;
            }
        }

        tick.borrow_and_update();
        let silenced = {
            let inner = shared.inner.lock().unwrap();
            pending.extend(inner.log[cursor..].iter().cloned());
            cursor = inner.log.len();
            inner.silence_epoch != epoch
        };
        if silenced {
            // Hold the connection open, never write, never read.
            let _keep = stream;
            std::future::pending::<()>().await;
            return;
        }
        if !pending.is_empty() {
            continue;
        }
        let timed_out = match deadline {
            Some(d) => tokio::select! {
                r = tick.changed() => { if r.is_err() { return; } false }
                () = tokio::time::sleep_until(d) => true,
            },
            None => tick.changed().await.is_err(),
        };
        // A watch silenced at the same moment stays silent rather than ending cleanly.
        if timed_out && shared.inner.lock().unwrap().silence_epoch == epoch {
            let _ = stream.write_all(b"0\r\n\r\n").await;
            return;
        }
    }
}

/// A ClusterIP Service with one TCP port.
pub fn service(namespace: &str, name: &str, cluster_ip: &str, port: u16) -> Value {
    json!({
        "metadata": {"namespace": namespace, "name": name},
        "spec": {"type": "ClusterIP", "clusterIP": cluster_ip, "clusterIPs": [cluster_ip],
                 "ports": [{"port": port, "protocol": "TCP", "targetPort": port}]}
    })
}

/// An IPv4 EndpointSlice of `service` with ready endpoints on `port`.
pub fn slice(namespace: &str, name: &str, service: &str, addrs: &[&str], port: u16) -> Value {
    let endpoints: Vec<Value> = addrs
        .iter()
        .map(|a| json!({"addresses": [a], "conditions": {"ready": true}}))
        .collect();
    json!({
        "metadata": {"namespace": namespace, "name": name,
                     "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "ports": [{"port": port, "protocol": "TCP"}],
        "endpoints": endpoints
    })
}

/// A ServiceCIDR with these ranges.
pub fn service_cidr(name: &str, cidrs: &[&str]) -> Value {
    json!({"metadata": {"name": name}, "spec": {"cidrs": cidrs}})
}

/// A Node with one InternalIP.
pub fn node(name: &str, internal_ip: &str) -> Value {
    json!({
        "metadata": {"name": name},
        "spec": {"podCIDRs": ["10.244.0.0/24"]},
        "status": {"addresses": [{"type": "InternalIP", "address": internal_ip}]}
    })
}
