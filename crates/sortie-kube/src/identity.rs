//! Who dialed, as the cluster says: a driver's identity token reviewed by the apiserver
//! (`TokenReview`, asked with the worker's own credential through its cluster client), for audience
//! `sortie-gateway`, of the sandboxes' service account, bound to a pod.

use std::time::Duration;

use async_trait::async_trait;
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use kube::api::{Api, PostParams};
use sortie_gateway::links::{
    DriverIdentity, IdentityCheck, IdentityRefused, ReviewedUser, TokenReviewStatus, identity_of,
};
use sortie_protocol::driver::LINK_AUDIENCE;

/// How long the apiserver may take to review a token.
const REVIEW_DEADLINE: Duration = Duration::from_secs(5);

/// [`IdentityCheck`] by the cluster's `TokenReview`.
pub struct ClusterIdentity {
    reviews: Api<TokenReview>,
    /// `system:serviceaccount:<namespace>:<name>` of the sandbox pods.
    sandbox_account: String,
}

impl ClusterIdentity {
    pub fn new(client: kube::Client, namespace: &str, sandbox_service_account: &str) -> Self {
        Self {
            reviews: Api::all(client),
            sandbox_account: format!("system:serviceaccount:{namespace}:{sandbox_service_account}"),
        }
    }
}

#[async_trait]
impl IdentityCheck for ClusterIdentity {
    async fn identify(&self, token: &str) -> Result<DriverIdentity, IdentityRefused> {
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: Some(token.to_owned()),
                audiences: Some(vec![LINK_AUDIENCE.to_owned()]),
            },
            ..TokenReview::default()
        };
        let reviewed = tokio::time::timeout(REVIEW_DEADLINE, self.reviews.create(&PostParams::default(), &review))
            .await
            .map_err(|_| IdentityRefused::Unavailable(format!("no answer within {REVIEW_DEADLINE:?}")))?
            .map_err(|error| IdentityRefused::Unavailable(error.to_string()))?;
        let status = reviewed.status.unwrap_or_default();
        let user = status.user.unwrap_or_default();
        identity_of(
            TokenReviewStatus {
                authenticated: status.authenticated.unwrap_or(false),
                user: ReviewedUser {
                    username: user.username.unwrap_or_default(),
                    uid: user.uid.unwrap_or_default(),
                    extra: user.extra.unwrap_or_default().into_iter().collect(),
                },
                audiences: status.audiences.unwrap_or_default(),
                error: status.error,
            },
            &self.sandbox_account,
        )
    }
}
