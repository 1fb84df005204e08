//! A fake Kubernetes apiserver on `127.0.0.1:0`, speaking the real JSON of the parts sortie uses. So far:
//! `TokenReview` (`POST /apis/authentication.k8s.io/v1/tokenreviews`), for the projected,
//! pod-bound service-account tokens drivers identify themselves with. Answers are shaped as the real
//! apiserver's: a review of an unknown or revoked token, or one for another audience, is
//! `authenticated: false` with an `error`; a caller without the reviewer's bearer gets a `Status` 401.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde_json::{Value, json};

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

#[derive(Default)]
struct Cluster {
    tokens: HashMap<String, Issued>,
    reviews: usize,
    next: u64,
}

#[derive(Clone)]
struct Fake {
    reviewer_bearer: String,
    cluster: Arc<Mutex<Cluster>>,
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
        };
        let app = axum::Router::new()
            .route("/apis/authentication.k8s.io/v1/tokenreviews", post(review))
            .with_state(fake.clone());
        Self {
            stub: crate::http::serve(app).await,
            fake,
        }
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
        let mut cluster = self.fake.cluster.lock().unwrap_or_else(|p| p.into_inner());
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
