//! A fake Kubernetes apiserver on `127.0.0.1:0`, speaking the real JSON of the parts sortie uses:
//!
//! - namespaced objects of any kind under `/api/v1/…` and `/apis/<group>/<version>/…`: create, get,
//!   list and watch (label and `metadata.name` field selectors; `resourceVersion`, bookmarks, `410
//!   Expired` once history is compacted, which [`FakeApiserver::compact`] forces), apply and merge
//!   patches, delete; errors as `Status` objects with the real reasons (`NotFound`, `AlreadyExists`); a
//!   Service gets a cluster IP when it is created;
//! - `TokenReview` (`POST /apis/authentication.k8s.io/v1/tokenreviews`) for the projected, pod-bound
//!   service-account tokens drivers identify themselves with: a review of an unknown or revoked token,
//!   or one for another audience, is `authenticated: false` with an `error`; a caller without the
//!   reviewer's bearer gets a `Status` 401.
//!
//! A test plays the cluster's controllers through [`FakeApiserver::changes`], [`FakeApiserver::get`] and
//! [`FakeApiserver::put`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::Json;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use tokio::sync::broadcast;

use crate::http::Stub;

/// A service-account token the fake issued.
#[derive(Clone, Debug)]
struct Issued {
    username: String,
    pod_name: String,
    pod_uid: String,
    audiences: Vec<String>,
    revoked: bool,
}

/// Where an object lives: its collection (`api/v1/pods`, `apis/<group>/<version>/<plural>`), namespace
/// and name.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ObjectKey {
    pub collection: String,
    pub namespace: String,
    pub name: String,
}

/// A change the fake made to an object, as a watch reports it.
#[derive(Clone, Debug)]
pub struct Change {
    pub kind: ChangeKind,
    pub key: ObjectKey,
    pub object: Value,
    pub resource_version: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChangeKind {
    Added,
    Modified,
    Deleted,
}

impl ChangeKind {
    fn as_str(self) -> &'static str {
        match self {
            Self::Added => "ADDED",
            Self::Modified => "MODIFIED",
            Self::Deleted => "DELETED",
        }
    }
}

#[derive(Default)]
struct Cluster {
    tokens: HashMap<String, Issued>,
    reviews: usize,
    next: u64,
    objects: std::collections::BTreeMap<ObjectKey, Value>,
    resource_version: u64,
    history: Vec<Change>,
    /// Watches from a resource version below this get `410 Expired`.
    compacted: u64,
    requests: Vec<String>,
}

#[derive(Clone)]
struct Fake {
    reviewer_bearer: String,
    cluster: Arc<Mutex<Cluster>>,
    changes: broadcast::Sender<Change>,
    /// Bumped to end every open watch (as an apiserver restart or a watch timeout would).
    watches: Arc<tokio::sync::watch::Sender<u64>>,
}

impl Fake {
    fn lock(&self) -> std::sync::MutexGuard<'_, Cluster> {
        self.cluster.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Stores `object` (created when absent), stamped with a new resource version, and tells watchers.
    fn put(&self, key: ObjectKey, mut object: Value) -> Value {
        let mut cluster = self.lock();
        cluster.resource_version += 1;
        let rv = cluster.resource_version;
        let existed = cluster.objects.get(&key).cloned();
        let metadata = &mut object["metadata"];
        metadata["name"] = json!(key.name);
        metadata["namespace"] = json!(key.namespace);
        metadata["resourceVersion"] = json!(rv.to_string());
        match &existed {
            Some(old) => {
                metadata["uid"] = old["metadata"]["uid"].clone();
                metadata["creationTimestamp"] = old["metadata"]["creationTimestamp"].clone();
                let generation = old["metadata"]["generation"].as_u64().unwrap_or(1);
                let changed_spec = old.get("spec") != object.get("spec");
                object["metadata"]["generation"] = json!(generation + u64::from(changed_spec));
            }
            None => {
                cluster.next += 1;
                let uid = format!("{:08x}-0000-4000-8000-{:012x}", cluster.next, rv);
                metadata["uid"] = json!(uid);
                metadata["creationTimestamp"] = json!("2026-12-06T00:00:00Z");
                metadata["generation"] = json!(1);
                // As the apiserver does at creation: a Service gets its cluster IP, for good.
                if key.collection == "api/v1/services" && object["spec"]["clusterIP"].as_str().is_none_or(str::is_empty)
                {
                    object["spec"]["clusterIP"] =
                        json!(format!("10.96.{}.{}", (cluster.next >> 8) & 0xff, cluster.next & 0xff));
                }
            }
        }
        cluster.objects.insert(key.clone(), object.clone());
        let change = Change {
            kind: if existed.is_some() {
                ChangeKind::Modified
            } else {
                ChangeKind::Added
            },
            key,
            object: object.clone(),
            resource_version: rv,
        };
        cluster.history.push(change.clone());
        drop(cluster);
        let _ = self.changes.send(change);
        object
    }

    fn delete(&self, key: &ObjectKey) -> Option<Value> {
        let mut cluster = self.lock();
        let mut object = cluster.objects.remove(key)?;
        cluster.resource_version += 1;
        let rv = cluster.resource_version;
        object["metadata"]["resourceVersion"] = json!(rv.to_string());
        let change = Change {
            kind: ChangeKind::Deleted,
            key: key.clone(),
            object: object.clone(),
            resource_version: rv,
        };
        cluster.history.push(change.clone());
        drop(cluster);
        let _ = self.changes.send(change);
        Some(object)
    }
}

/// The fake apiserver; stops when dropped.
pub struct FakeApiserver {
    stub: Stub,
    fake: Fake,
}

impl FakeApiserver {
    /// Reviews come only from a caller with `reviewer_bearer` (the gateway's own token).
    pub async fn start(reviewer_bearer: &str) -> Self {
        let fake = Fake {
            reviewer_bearer: reviewer_bearer.to_owned(),
            cluster: Arc::default(),
            changes: broadcast::channel(1024).0,
            watches: Arc::new(tokio::sync::watch::channel(0).0),
        };
        let app = axum::Router::new()
            .route("/apis/authentication.k8s.io/v1/tokenreviews", post(review))
            .route(
                "/api/{version}/namespaces/{ns}/{plural}",
                get(list_core).post(create_core),
            )
            .route(
                "/api/{version}/namespaces/{ns}/{plural}/{name}",
                get(get_core).delete(delete_core).patch(patch_core),
            )
            .route(
                "/apis/{group}/{version}/namespaces/{ns}/{plural}",
                get(list_group).post(create_group),
            )
            .route(
                "/apis/{group}/{version}/namespaces/{ns}/{plural}/{name}",
                get(get_group).delete(delete_group).patch(patch_group),
            )
            .layer(axum::middleware::from_fn_with_state(fake.clone(), note_request))
            .with_state(fake.clone());
        Self {
            stub: crate::http::serve(app).await,
            fake,
        }
    }

    /// The object at `key`, if any.
    pub fn get(&self, key: &ObjectKey) -> Option<Value> {
        self.fake.lock().objects.get(key).cloned()
    }

    /// Every object of `collection` in `namespace`.
    pub fn list(&self, collection: &str, namespace: &str) -> Vec<Value> {
        self.fake
            .lock()
            .objects
            .iter()
            .filter(|(key, _)| key.collection == collection && key.namespace == namespace)
            .map(|(_, object)| object.clone())
            .collect()
    }

    /// Stores `object` at `key` as a controller would (status included), telling watchers.
    pub fn put(&self, key: ObjectKey, object: Value) -> Value {
        self.fake.put(key, object)
    }

    pub fn delete(&self, key: &ObjectKey) -> Option<Value> {
        self.fake.delete(key)
    }

    /// Every change from now on.
    pub fn changes(&self) -> broadcast::Receiver<Change> {
        self.fake.changes.subscribe()
    }

    /// Forgets the history so far and ends every open watch: a client watching again from an earlier
    /// resource version gets `410 Expired`, as after etcd's compaction, and must list again.
    pub fn compact(&self) {
        {
            let mut cluster = self.fake.lock();
            cluster.compacted = cluster.resource_version + 1;
            cluster.history.clear();
        }
        self.fake.watches.send_modify(|epoch| *epoch += 1);
    }

    /// The requests the fake served, `METHOD path?query`, in order.
    pub fn requests(&self) -> Vec<String> {
        self.fake.lock().requests.clone()
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        self.stub.url()
    }

    /// Issues a token of service account `namespace/account` bound to pod `pod_name` (uid `pod_uid`) for
    /// `audiences`, as the kubelet projects one into the pod.
    pub fn issue_token(
        &self,
        namespace: &str,
        account: &str,
        pod_name: &str,
        pod_uid: &str,
        audiences: &[&str],
    ) -> String {
        let mut cluster = self.fake.lock();
        cluster.next += 1;
        let token = format!("eyJhbGciOiJSUzI1NiJ9.fake-{}-{pod_uid}.sig", cluster.next);
        cluster.tokens.insert(
            token.clone(),
            Issued {
                username: format!("system:serviceaccount:{namespace}:{account}"),
                pod_name: pod_name.to_owned(),
                pod_uid: pod_uid.to_owned(),
                audiences: audiences.iter().map(|a| (*a).to_owned()).collect(),
                revoked: false,
            },
        );
        token
    }

    /// The token's pod is gone: its token no longer authenticates.
    pub fn revoke(&self, token: &str) {
        if let Some(issued) = self
            .fake
            .cluster
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .tokens
            .get_mut(token)
        {
            issued.revoked = true;
        }
    }

    /// How many reviews the fake answered.
    pub fn reviews(&self) -> usize {
        self.fake.cluster.lock().unwrap_or_else(|p| p.into_inner()).reviews
    }
}

fn status(code: StatusCode, reason: &str, message: &str) -> Response {
    (
        code,
        Json(json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code.as_u16()
        })),
    )
        .into_response()
}

async fn review(State(fake): State<Fake>, headers: HeaderMap, body: axum::body::Bytes) -> Response {
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    if bearer != Some(fake.reviewer_bearer.as_str()) {
        return status(StatusCode::UNAUTHORIZED, "Unauthorized", "Unauthorized");
    }
    let Ok(request) = serde_json::from_slice::<Value>(&body) else {
        return status(StatusCode::BAD_REQUEST, "BadRequest", "the body is not JSON");
    };
    if request["kind"] != "TokenReview" || request["apiVersion"] != "authentication.k8s.io/v1" {
        return status(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            "not an authentication.k8s.io/v1 TokenReview",
        );
    }
    let token = request["spec"]["token"].as_str().unwrap_or_default();
    let wanted: Vec<String> = request["spec"]["audiences"]
        .as_array()
        .map(|a| a.iter().filter_map(|v| v.as_str().map(str::to_owned)).collect())
        .unwrap_or_default();
    let issued = {
        let mut cluster = fake.cluster.lock().unwrap_or_else(|p| p.into_inner());
        cluster.reviews += 1;
        cluster.tokens.get(token).cloned()
    };
    let status = match issued {
        Some(issued) if !issued.revoked => {
            let audiences: Vec<&String> = issued.audiences.iter().filter(|a| wanted.contains(a)).collect();
            if audiences.is_empty() {
                json!({"authenticated": false, "user": {}, "error": "[invalid bearer token, token audiences [\"x\"] is invalid for the target audiences]"})
            } else {
                json!({
                    "authenticated": true,
                    "user": {
                        "username": issued.username,
                        "uid": format!("sa-{}", issued.username.len()),
                        "groups": ["system:serviceaccounts", "system:authenticated"],
                        "extra": {
                            "authentication.kubernetes.io/pod-name": [issued.pod_name],
                            "authentication.kubernetes.io/pod-uid": [issued.pod_uid]
                        }
                    },
                    "audiences": audiences
                })
            }
        }
        _ => {
            json!({"authenticated": false, "user": {}, "error": "[invalid bearer token, service account token has been invalidated]"})
        }
    };
    (
        StatusCode::CREATED,
        Json(json!({
            "kind": "TokenReview",
            "apiVersion": "authentication.k8s.io/v1",
            "metadata": {"creationTimestamp": null},
            "spec": request["spec"],
            "status": status
        })),
    )
        .into_response()
}

async fn note_request(
    State(fake): State<Fake>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let line = match request.uri().query() {
        Some(query) => format!("{} {}?{query}", request.method(), request.uri().path()),
        None => format!("{} {}", request.method(), request.uri().path()),
    };
    fake.lock().requests.push(line);
    next.run(request).await
}

fn core_key(version: &str, ns: String, plural: &str, name: String) -> ObjectKey {
    ObjectKey {
        collection: format!("api/{version}/{plural}"),
        namespace: ns,
        name,
    }
}

fn group_key(group: &str, version: &str, ns: String, plural: &str, name: String) -> ObjectKey {
    ObjectKey {
        collection: format!("apis/{group}/{version}/{plural}"),
        namespace: ns,
        name,
    }
}

/// The `apiVersion` of objects in `collection`.
fn api_version(collection: &str) -> String {
    let parts: Vec<&str> = collection.split('/').collect();
    match parts.as_slice() {
        ["api", version, _] => (*version).to_owned(),
        ["apis", group, version, _] => format!("{group}/{version}"),
        _ => String::new(),
    }
}

async fn list_core(
    State(fake): State<Fake>,
    Path((version, ns, plural)): Path<(String, String, String)>,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    list_or_watch(fake, core_key(&version, ns, &plural, String::new()), query).await
}

async fn list_group(
    State(fake): State<Fake>,
    Path((group, version, ns, plural)): Path<(String, String, String, String)>,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    list_or_watch(fake, group_key(&group, &version, ns, &plural, String::new()), query).await
}

async fn create_core(
    State(fake): State<Fake>,
    Path((version, ns, plural)): Path<(String, String, String)>,
    Json(object): Json<Value>,
) -> Response {
    let name = object["metadata"]["name"].as_str().unwrap_or_default().to_owned();
    create(fake, core_key(&version, ns, &plural, name), object)
}

async fn create_group(
    State(fake): State<Fake>,
    Path((group, version, ns, plural)): Path<(String, String, String, String)>,
    Json(object): Json<Value>,
) -> Response {
    let name = object["metadata"]["name"].as_str().unwrap_or_default().to_owned();
    create(fake, group_key(&group, &version, ns, &plural, name), object)
}

async fn get_core(
    State(fake): State<Fake>,
    Path((version, ns, plural, name)): Path<(String, String, String, String)>,
) -> Response {
    read(fake, core_key(&version, ns, &plural, name))
}

async fn get_group(
    State(fake): State<Fake>,
    Path((group, version, ns, plural, name)): Path<(String, String, String, String, String)>,
) -> Response {
    read(fake, group_key(&group, &version, ns, &plural, name))
}

async fn delete_core(
    State(fake): State<Fake>,
    Path((version, ns, plural, name)): Path<(String, String, String, String)>,
) -> Response {
    remove(fake, core_key(&version, ns, &plural, name))
}

async fn delete_group(
    State(fake): State<Fake>,
    Path((group, version, ns, plural, name)): Path<(String, String, String, String, String)>,
) -> Response {
    remove(fake, group_key(&group, &version, ns, &plural, name))
}

async fn patch_core(
    State(fake): State<Fake>,
    Path((version, ns, plural, name)): Path<(String, String, String, String)>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    patch(fake, core_key(&version, ns, &plural, name), &headers, &body)
}

async fn patch_group(
    State(fake): State<Fake>,
    Path((group, version, ns, plural, name)): Path<(String, String, String, String, String)>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    patch(fake, group_key(&group, &version, ns, &plural, name), &headers, &body)
}

fn not_found(key: &ObjectKey) -> Response {
    let plural = key.collection.rsplit('/').next().unwrap_or_default();
    status(
        StatusCode::NOT_FOUND,
        "NotFound",
        &format!("{plural} \"{}\" not found", key.name),
    )
}

fn create(fake: Fake, key: ObjectKey, object: Value) -> Response {
    if key.name.is_empty() {
        return status(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Invalid",
            "metadata.name: Required value",
        );
    }
    if fake.lock().objects.contains_key(&key) {
        let plural = key.collection.rsplit('/').next().unwrap_or_default();
        return status(
            StatusCode::CONFLICT,
            "AlreadyExists",
            &format!("{plural} \"{}\" already exists", key.name),
        );
    }
    (StatusCode::CREATED, Json(fake.put(key, object))).into_response()
}

fn read(fake: Fake, key: ObjectKey) -> Response {
    match fake.lock().objects.get(&key) {
        Some(object) => Json(object.clone()).into_response(),
        None => not_found(&key),
    }
}

fn remove(fake: Fake, key: ObjectKey) -> Response {
    match fake.delete(&key) {
        Some(object) => Json(object).into_response(),
        None => not_found(&key),
    }
}

/// RFC 7386 JSON merge patch: what both server-side apply of a whole object and a merge patch come to
/// in a fake that keeps no field managers.
fn merge(target: &mut Value, patch: &Value) {
    match (target, patch) {
        (Value::Object(target), Value::Object(patch)) => {
            for (key, value) in patch {
                if value.is_null() {
                    target.remove(key);
                } else {
                    merge(target.entry(key.clone()).or_insert(Value::Null), value);
                }
            }
        }
        (target, patch) => *target = patch.clone(),
    }
}

fn patch(fake: Fake, key: ObjectKey, headers: &HeaderMap, body: &[u8]) -> Response {
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    let apply = content_type.starts_with("application/apply-patch");
    if !apply && !content_type.starts_with("application/merge-patch+json") {
        return status(StatusCode::UNSUPPORTED_MEDIA_TYPE, "UnsupportedMediaType", content_type);
    }
    let Ok(patch) = serde_json::from_slice::<Value>(body) else {
        return status(StatusCode::BAD_REQUEST, "BadRequest", "the patch is not JSON");
    };
    let existing = fake.lock().objects.get(&key).cloned();
    let object = match existing {
        Some(mut object) => {
            merge(&mut object, &patch);
            object
        }
        None if apply => patch,
        None => return not_found(&key),
    };
    Json(fake.put(key, object)).into_response()
}

/// `k=v,k2=v2` (equality only, as sortie uses them).
fn matches_selector(object: &Value, path: &str, selector: Option<&String>) -> bool {
    let Some(selector) = selector.filter(|s| !s.is_empty()) else {
        return true;
    };
    selector.split(',').all(|term| match term.split_once('=') {
        Some((key, value)) => {
            let key = key.trim_end_matches('=');
            let actual = if path == "labels" {
                object["metadata"]["labels"][key].as_str()
            } else if key == "metadata.name" {
                object["metadata"]["name"].as_str()
            } else if key == "metadata.namespace" {
                object["metadata"]["namespace"].as_str()
            } else {
                None
            };
            actual == Some(value)
        }
        None => object["metadata"]["labels"].get(term).is_some(),
    })
}

fn selected(object: &Value, query: &HashMap<String, String>) -> bool {
    matches_selector(object, "labels", query.get("labelSelector"))
        && matches_selector(object, "fields", query.get("fieldSelector"))
}

async fn list_or_watch(fake: Fake, key: ObjectKey, query: HashMap<String, String>) -> Response {
    let collection = key.collection.clone();
    let namespace = key.namespace.clone();
    let version = api_version(&collection);
    let watch = matches!(query.get("watch").map(String::as_str), Some("true" | "1"));
    if !watch {
        let cluster = fake.lock();
        let items: Vec<Value> = cluster
            .objects
            .iter()
            .filter(|(k, object)| k.collection == collection && k.namespace == namespace && selected(object, &query))
            .map(|(_, object)| object.clone())
            .collect();
        let kind = items
            .first()
            .and_then(|o| o["kind"].as_str())
            .map(|k| format!("{k}List"))
            .unwrap_or_else(|| "List".into());
        return Json(json!({
            "apiVersion": version,
            "kind": kind,
            "metadata": {"resourceVersion": cluster.resource_version.to_string()},
            "items": items
        }))
        .into_response();
    }
    let from: u64 = query.get("resourceVersion").and_then(|v| v.parse().ok()).unwrap_or(0);
    let bookmarks = query.get("allowWatchBookmarks").is_some_and(|v| v == "true");
    let timeout = query
        .get("timeoutSeconds")
        .and_then(|v| v.parse().ok())
        .map_or(std::time::Duration::from_secs(290), std::time::Duration::from_secs);
    // Subscribed before the history is read, so nothing falls between the two.
    let mut live = fake.changes.subscribe();
    let mut ended = fake.watches.subscribe();
    let (backlog, expired, now) = {
        let cluster = fake.lock();
        let expired = from != 0 && from < cluster.compacted;
        let backlog: Vec<Change> = cluster
            .history
            .iter()
            .filter(|c| c.resource_version > from && c.key.collection == collection && c.key.namespace == namespace)
            .cloned()
            .collect();
        (backlog, expired, cluster.resource_version)
    };
    let line = |value: Value| {
        let mut bytes = serde_json::to_vec(&value).unwrap_or_default();
        bytes.push(b'\n');
        Ok::<_, std::io::Error>(axum::body::Bytes::from(bytes))
    };
    let (sender, receiver) = tokio::sync::mpsc::channel::<Result<axum::body::Bytes, std::io::Error>>(64);
    tokio::spawn(async move {
        if expired {
            let gone = json!({"type": "ERROR", "object": {
                "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": format!("too old resource version: {from} ({now})"), "reason": "Expired", "code": 410
            }});
            let _ = sender.send(line(gone)).await;
            return;
        }
        let mut last = from;
        let event = |change: &Change| json!({"type": change.kind.as_str(), "object": change.object});
        for change in backlog {
            last = change.resource_version;
            if selected(&change.object, &query) && sender.send(line(event(&change))).await.is_err() {
                return;
            }
        }
        let deadline = tokio::time::Instant::now() + timeout;
        let mut bookmark = tokio::time::interval(std::time::Duration::from_millis(500));
        loop {
            tokio::select! {
                () = tokio::time::sleep_until(deadline) => return,
                _ = ended.changed() => return,
                _ = bookmark.tick(), if bookmarks => {
                    let mark = json!({"type": "BOOKMARK", "object": {
                        "apiVersion": version, "kind": "Bookmark",
                        "metadata": {"resourceVersion": last.max(from).to_string()}
                    }});
                    if sender.send(line(mark)).await.is_err() {
                        return;
                    }
                }
                change = live.recv() => match change {
                    Ok(change) => {
                        if change.resource_version <= last
                            || change.key.collection != collection
                            || change.key.namespace != namespace
                        {
                            continue;
                        }
                        last = change.resource_version;
                        if selected(&change.object, &query) && sender.send(line(event(&change))).await.is_err() {
                            return;
                        }
                    }
                    Err(_) => return,
                },
            }
        }
    });
    let body = axum::body::Body::from_stream(tokio_stream_from(receiver));
    ([(header::CONTENT_TYPE, "application/json")], body).into_response()
}

fn tokio_stream_from<T: Send + 'static>(
    mut receiver: tokio::sync::mpsc::Receiver<T>,
) -> impl futures::Stream<Item = T> + Send + 'static {
    futures::stream::poll_fn(move |cx| receiver.poll_recv(cx))
}
