//! Waiting in tests without sleeping for synchronization: poll a probe until it holds, within a
//! deadline, and fail saying what was awaited and what was last seen. One patience knob for a slow
//! machine: `SORTIE_TEST_PATIENCE` multiplies every deadline (default 1).
//!
//! The async forms read tokio's clock, so a test under paused time (`start_paused = true`) waits in
//! virtual time.

use std::fmt::Debug;
use std::time::Duration;

/// How often a probe is asked again.
pub const POLL: Duration = Duration::from_millis(20);

/// `within`, stretched by `SORTIE_TEST_PATIENCE` (a whole number, default 1).
pub fn patience(within: Duration) -> Duration {
    let factor = std::env::var("SORTIE_TEST_PATIENCE")
        .ok()
        .and_then(|text| text.parse::<u32>().ok())
        .filter(|factor| *factor > 0)
        .unwrap_or(1);
    within * factor
}

/// Asks `probe` every [`POLL`] until it answers `Ok`, and returns that; panics after `within` with
/// `what` and the last `Err` (what the probe last saw).
pub async fn eventually<T, E: Debug, F: Future<Output = Result<T, E>>>(
    what: &str,
    within: Duration,
    mut probe: impl FnMut() -> F,
) -> T {
    let within = patience(within);
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let last = match probe().await {
            Ok(value) => return value,
            Err(last) => last,
        };
        assert!(
            tokio::time::Instant::now() < deadline,
            "not within {within:?}: {what}; last seen: {last:?}"
        );
        tokio::time::sleep(POLL).await;
    }
}

/// [`eventually`] for a test without a runtime, on the thread's own clock.
pub fn eventually_blocking<T, E: Debug>(what: &str, within: Duration, mut probe: impl FnMut() -> Result<T, E>) -> T {
    let within = patience(within);
    let deadline = std::time::Instant::now() + within;
    loop {
        let last = match probe() {
            Ok(value) => return value,
            Err(last) => last,
        };
        assert!(
            std::time::Instant::now() < deadline,
            "not within {within:?}: {what}; last seen: {last:?}"
        );
        std::thread::sleep(POLL);
    }
}

/// `future`'s output, or a panic naming `what` if it takes longer than `within`.
pub async fn within<F: IntoFuture>(what: &str, within: Duration, future: F) -> F::Output {
    let within = patience(within);
    match tokio::time::timeout(within, future).await {
        Ok(output) => output,
        Err(_) => panic!("not within {within:?}: {what}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Paused time: the deadlines below pass in virtual time, so these take no real time at all.
    #[tokio::test(start_paused = true)]
    async fn a_probe_that_comes_true_is_waited_for() {
        let started = tokio::time::Instant::now();
        let mut asked = 0;
        let found = eventually("the third answer", Duration::from_secs(60), || {
            asked += 1;
            std::future::ready(if asked == 3 { Ok(asked) } else { Err(asked) })
        })
        .await;
        assert_eq!(found, 3);
        assert_eq!(started.elapsed(), POLL * 2, "asked again every POLL");
    }

    #[tokio::test(start_paused = true)]
    async fn a_probe_that_never_comes_true_fails_at_the_deadline_saying_what_it_saw() {
        let waited = tokio::spawn(eventually("never", Duration::from_secs(5), || {
            std::future::ready(Err::<(), _>("still no"))
        }));
        let error = waited.await.expect_err("it panics");
        let said = error.into_panic();
        let said = said.downcast_ref::<String>().map(String::as_str).unwrap_or_default();
        assert!(said.contains("never") && said.contains("still no"), "{said}");
    }

    #[tokio::test(start_paused = true)]
    async fn within_gives_the_output_or_names_what_took_too_long() {
        assert_eq!(within("ready", Duration::from_secs(1), async { 7 }).await, 7);
        let slow = tokio::spawn(within(
            "slow",
            Duration::from_secs(1),
            tokio::time::sleep(Duration::from_secs(2)),
        ));
        assert!(slow.await.is_err());
    }
}
