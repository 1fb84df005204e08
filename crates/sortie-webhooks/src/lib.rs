//! Webhook deliveries (DESIGN §14). The outbox is the store's event log: every change is written as an
//! event in the transaction that makes it, and the [`Dispatcher`] turns each webhook's new events into
//! deliveries (moving its cursor with a compare-and-set, so replicas never enqueue one twice), then
//! POSTs each one signed — `X-Sortie-Signature: sha256=<hex HMAC-SHA256 of the body>` with
//! `X-Sortie-Event` and `X-Sortie-Delivery` — and retries with backoff for 24 h. It runs on its own
//! task: a slow or dead receiver never holds up a turn.
//!
//! A webhook's URL passes the egress rules ([`check_url`]): `http` or `https`, no credentials, and
//! every address its host resolves to public unless an operator exempted its range — checked when the
//! webhook is made and again at each delivery, which connects only to an address it vetted.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hmac::{Hmac, KeyInit, Mac};
use reqwest::Url;
use sha2::Sha256;
use sortie_protocol::egress::{Cidr, forbidden_address};
use sortie_store::{AttemptOutcome, DeliveryRow, KeyRing, NewDelivery, Store, WebhookRow, now_ms};

/// The longest URL a webhook may have.
pub const URL_MAX_BYTES: usize = 2048;
/// How long one attempt may take.
pub const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(10);
/// Deliveries attempted at once by one dispatcher.
const BATCH: u32 = 16;
/// Events read per webhook at a time.
const EVENTS_PAGE: u32 = 256;

/// Signs a body: the value of `X-Sortie-Signature`.
pub fn sign(secret: &[u8], body: &[u8]) -> String {
    let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(secret).unwrap_or_else(|_| {
        // HMAC takes a key of any length; this branch cannot be taken.
        <Hmac<Sha256> as KeyInit>::new_from_slice(b"").expect("an empty HMAC key")
    });
    mac.update(body);
    let digest = mac.finalize().into_bytes();
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256={hex}")
}

/// Why a webhook URL is refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UrlRefusal(pub String);

impl std::fmt::Display for UrlRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// The URL's form: `http` or `https`, a host, no credentials, not too long.
pub fn parse_url(text: &str) -> Result<Url, UrlRefusal> {
    let refuse = |why: &str| Err(UrlRefusal(why.to_owned()));
    if text.len() > URL_MAX_BYTES {
        return refuse("the URL is longer than 2048 bytes");
    }
    let Ok(url) = Url::parse(text) else {
        return refuse("not a URL");
    };
    if !matches!(url.scheme(), "http" | "https") {
        return refuse("the URL must be http:// or https://");
    }
    if !url.username().is_empty() || url.password().is_some() {
        return refuse("the URL must not carry credentials (the secret signs each delivery)");
    }
    if url.host_str().is_none_or(str::is_empty) {
        return refuse("the URL has no host");
    }
    Ok(url)
}

/// The addresses a delivery to `url` may connect to: every one its host resolves to, each public or
/// exempted; any other refuses the URL (a name must not lead to a private address).
pub async fn vetted_addresses(url: &Url, exempt: &[Cidr]) -> Result<Vec<SocketAddr>, UrlRefusal> {
    let host = url
        .host_str()
        .unwrap_or_default()
        .trim_start_matches('[')
        .trim_end_matches(']');
    let port = url.port_or_known_default().unwrap_or(443);
    let addresses: Vec<SocketAddr> = match host.parse::<std::net::IpAddr>() {
        Ok(ip) => vec![SocketAddr::new(ip, port)],
        Err(_) => tokio::net::lookup_host((host, port))
            .await
            .map_err(|error| UrlRefusal(format!("{host} does not resolve: {error}")))?
            .collect(),
    };
    if addresses.is_empty() {
        return Err(UrlRefusal(format!("{host} resolves to no address")));
    }
    if let Some((address, why)) = addresses
        .iter()
        .find_map(|a| forbidden_address(a.ip(), exempt).map(|why| (a, why)))
    {
        return Err(UrlRefusal(format!(
            "{host} resolves to {}, {why}: webhooks reach public addresses only",
            address.ip()
        )));
    }
    Ok(addresses)
}

/// Checks a URL for a new webhook: its form and where it leads.
pub async fn check_url(text: &str, exempt: &[Cidr]) -> Result<Url, UrlRefusal> {
    let url = parse_url(text)?;
    vetted_addresses(&url, exempt).await?;
    Ok(url)
}

/// When the next attempt goes after a failed one, and when the dispatcher gives up.
#[derive(Clone, Copy, Debug)]
pub struct Backoff {
    /// After the first failure; doubled after each further one.
    pub first: Duration,
    pub max: Duration,
    /// A delivery not made this long after its event is given up on.
    pub give_up_after: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            first: Duration::from_secs(1),
            max: Duration::from_secs(60 * 60),
            give_up_after: Duration::from_secs(24 * 60 * 60),
        }
    }
}

impl Backoff {
    /// The wait after `attempts` failed attempts (1 or more).
    pub fn delay(&self, attempts: u32) -> Duration {
        let doublings = attempts.saturating_sub(1).min(30);
        self.first.saturating_mul(1 << doublings).min(self.max)
    }
}

/// Fans events out into deliveries and makes them, for as long as the process runs.
pub struct Dispatcher {
    pub store: Arc<dyn Store>,
    pub keyring: Arc<KeyRing>,
    /// Ranges a webhook may reach although private (an internal receiver; tests).
    pub exempt: Vec<Cidr>,
    pub backoff: Backoff,
    /// How often the dispatcher looks for work when no event woke it.
    pub tick: Duration,
}

impl Dispatcher {
    pub async fn run(self) {
        let mut signal = self.store.event_signal();
        loop {
            signal.borrow_and_update();
            let webhooks = match self.store.webhooks(None).await {
                Ok(webhooks) => webhooks,
                Err(error) => {
                    tracing::warn!(%error, "webhooks: the store did not answer");
                    tokio::time::sleep(self.tick).await;
                    continue;
                }
            };
            for webhook in &webhooks {
                if let Err(error) = self.fan_out(webhook).await {
                    tracing::warn!(%error, webhook = %webhook.id, "webhooks: cannot enqueue deliveries");
                }
            }
            match self.store.claim_due_deliveries(now_ms(), lease_until(), BATCH).await {
                Ok(due) => {
                    let attempts = due.iter().map(|delivery| self.attempt(delivery, &webhooks));
                    futures::future::join_all(attempts).await;
                    if due.len() == BATCH as usize {
                        continue;
                    }
                }
                Err(error) => tracing::warn!(%error, "webhooks: cannot claim deliveries"),
            }
            tokio::select! {
                _ = signal.changed() => {}
                () = tokio::time::sleep(self.tick) => {}
            }
        }
    }

    /// The webhook's new events as deliveries (those of the kinds it takes), its cursor moved past them.
    async fn fan_out(&self, webhook: &WebhookRow) -> Result<(), sortie_store::StoreError> {
        let page = self
            .store
            .events_after(Some(&webhook.workspace_id), webhook.cursor, EVENTS_PAGE)
            .await?;
        let Some(last) = page.events.last().map(|e| e.seq) else {
            return Ok(());
        };
        if page.pruned_through > webhook.cursor {
            tracing::warn!(webhook = %webhook.id, "webhooks: events were pruned before they were delivered");
        }
        let deliveries: Vec<NewDelivery> = page
            .events
            .iter()
            .map(|row| row.to_event())
            .filter(|event| webhook.events.iter().any(|kind| kind == event.kind.as_str()))
            .filter_map(|event| {
                let payload = serde_json::to_string(&event).ok()?;
                Some(NewDelivery {
                    id: format!("dlv_{}", ulid::Ulid::generate().to_string().to_ascii_lowercase()),
                    event_seq: event.seq,
                    kind: event.kind.as_str().to_owned(),
                    payload,
                })
            })
            .collect();
        self.store
            .enqueue_deliveries(&webhook.id, webhook.cursor, last, &deliveries)
            .await?;
        Ok(())
    }

    async fn attempt(&self, delivery: &DeliveryRow, webhooks: &[WebhookRow]) {
        let outcome = match webhooks.iter().find(|w| w.id == delivery.webhook_id) {
            None => AttemptOutcome::GaveUp {
                status: None,
                error: "the webhook was deleted".into(),
            },
            Some(webhook) => match self.send(webhook, delivery).await {
                Ok(status) if (200..300).contains(&status) => AttemptOutcome::Delivered { status },
                Ok(status) => self.after_failure(delivery, Some(status), format!("the receiver answered {status}")),
                Err(error) => self.after_failure(delivery, None, error),
            },
        };
        metrics_outcome(&outcome);
        if let Err(error) = self.store.record_delivery_attempt(&delivery.id, &outcome).await {
            tracing::warn!(%error, delivery = %delivery.id, "webhooks: cannot record an attempt");
        }
    }

    fn after_failure(&self, delivery: &DeliveryRow, status: Option<u16>, error: String) -> AttemptOutcome {
        let delay = self.backoff.delay(delivery.attempts + 1);
        let next_at = now_ms().saturating_add(i64::try_from(delay.as_millis()).unwrap_or(i64::MAX));
        let give_up_at = delivery
            .created_at
            .saturating_add(i64::try_from(self.backoff.give_up_after.as_millis()).unwrap_or(i64::MAX));
        if next_at > give_up_at {
            AttemptOutcome::GaveUp { status, error }
        } else {
            AttemptOutcome::Retry { status, error, next_at }
        }
    }

    /// One POST of the delivery; the receiver's status, or why there was none.
    async fn send(&self, webhook: &WebhookRow, delivery: &DeliveryRow) -> Result<u16, String> {
        let secret = self
            .keyring
            .open_webhook_secret(
                &webhook.workspace_id,
                &webhook.id,
                &webhook.secret_ciphertext,
                &webhook.secret_nonce,
            )
            .map_err(|error| format!("the webhook's secret cannot be opened: {error}"))?;
        let url = parse_url(&webhook.url).map_err(|refusal| refusal.0)?;
        // Resolved and vetted now, and the connection pinned to a vetted address: a name that moved
        // to a private address since the webhook was made is refused, not followed.
        let addresses = vetted_addresses(&url, &self.exempt)
            .await
            .map_err(|refusal| refusal.0)?;
        let host = url.host_str().unwrap_or_default().to_owned();
        let client = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .timeout(ATTEMPT_TIMEOUT)
            .resolve_to_addrs(&host, &addresses)
            .build()
            .map_err(|error| format!("no HTTP client: {error}"))?;
        let response = client
            .post(url)
            .header("content-type", "application/json")
            .header("user-agent", "sortie-webhooks")
            .header("x-sortie-event", &delivery.kind)
            .header("x-sortie-delivery", &delivery.id)
            .header("x-sortie-signature", sign(secret.expose(), delivery.payload.as_bytes()))
            .body(delivery.payload.clone())
            .send()
            .await
            .map_err(|error| format!("the request failed: {error}"))?;
        Ok(response.status().as_u16())
    }
}

fn lease_until() -> i64 {
    // Longer than an attempt can take, so a lease never ends under a running attempt.
    now_ms().saturating_add(i64::try_from((ATTEMPT_TIMEOUT * 6).as_millis()).unwrap_or(i64::MAX))
}

fn metrics_outcome(outcome: &AttemptOutcome) {
    let label = match outcome {
        AttemptOutcome::Delivered { .. } => "delivered",
        AttemptOutcome::Retry { .. } => "retry",
        AttemptOutcome::GaveUp { .. } => "gave_up",
    };
    tracing::debug!(outcome = label, "webhooks: attempt");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signatures_are_hex_hmac_sha256_of_the_body() {
        // RFC 4231 test case 2.
        assert_eq!(
            sign(b"Jefe", b"what do ya want for nothing?"),
            "sha256=5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }

    #[test]
    fn urls_must_be_http_with_a_host_and_no_credentials() {
        assert!(parse_url("https://hooks.example.com/sortie").is_ok());
        assert!(parse_url("http://hooks.example.com:8080/x?y=1").is_ok());
        for bad in [
            "ftp://example.com/",
            "https://user:pass@example.com/",
            "not a url",
            "file:///etc/passwd",
            &format!("https://example.com/{}", "a".repeat(URL_MAX_BYTES)),
        ] {
            assert!(parse_url(bad).is_err(), "{bad}");
        }
    }

    #[tokio::test]
    async fn private_addresses_are_refused_unless_exempt() {
        for private in [
            "http://127.0.0.1:9/",
            "http://10.1.2.3/",
            "http://[::1]/",
            "http://169.254.169.254/",
            "http://localhost:9/",
        ] {
            let url = parse_url(private).expect("form");
            let refusal = vetted_addresses(&url, &[]).await.expect_err(private);
            assert!(refusal.0.contains("public addresses only"), "{private}: {refusal}");
        }
        let exempt = [Cidr::parse("127.0.0.1/32").expect("cidr")];
        let url = parse_url("http://127.0.0.1:9/").expect("form");
        assert_eq!(
            vetted_addresses(&url, &exempt).await,
            Ok(vec!["127.0.0.1:9".parse().expect("addr")])
        );
    }

    #[test]
    fn backoff_doubles_to_its_ceiling() {
        let backoff = Backoff::default();
        assert_eq!(backoff.delay(1), Duration::from_secs(1));
        assert_eq!(backoff.delay(2), Duration::from_secs(2));
        assert_eq!(backoff.delay(5), Duration::from_secs(16));
        assert_eq!(backoff.delay(40), Duration::from_secs(3600));
    }
}
