//! Table tests of the watch's state machine: every event and what it does, in order.

use super::*;

const TIMEOUT: Duration = Duration::from_secs(60);

/// What happened, as (seconds since the start, event) in order; what the last event does.
type Row = (&'static str, Vec<(f64, TurnEvent)>, Vec<TurnAction>);

fn tick(watch: &mut TurnWatch, started: Instant, secs: f64) -> Vec<TurnAction> {
    watch.step(TurnEvent::Tick {
        now: started + Duration::from_secs_f64(secs),
    })
}

fn report(ours: bool, state: TurnState, primed: bool) -> TurnEvent {
    TurnEvent::DriverReport { ours, state, primed }
}

#[test]
fn every_event_has_its_action() {
    use TurnAction::*;
    let running = || report(true, TurnState::Running, false);
    let rejected = || TurnEvent::VendorRejected("401 from the vendor".into());
    let limit = || TurnEvent::TranscriptLimit("too many parts".into());
    // (what happened, in order, as (seconds since the start, event); what the last event does)
    let table: Vec<Row> = vec![
        (
            "a quiet tick",
            vec![(1.0, TurnEvent::Tick { now: Instant::now() })],
            vec![],
        ),
        (
            "the recorder took the whole stream",
            vec![(1.0, TurnEvent::RecorderFinished)],
            vec![Settle],
        ),
        ("a running report", vec![(1.0, running())], vec![]),
        (
            "a report under another nonce",
            vec![(1.0, report(false, TurnState::Running, false))],
            vec![Foreign],
        ),
        (
            "the first primed report",
            vec![(1.0, report(true, TurnState::Running, true))],
            vec![NotePriming],
        ),
        (
            "a primed report again",
            vec![
                (1.0, report(true, TurnState::Running, true)),
                (1.5, report(true, TurnState::Running, true)),
            ],
            vec![],
        ),
        (
            "the driver delivers",
            vec![(1.0, report(true, TurnState::Delivering, false))],
            vec![MarkDelivering],
        ),
        (
            "the driver still delivers",
            vec![
                (1.0, report(true, TurnState::Delivering, false)),
                (1.5, report(true, TurnState::Delivering, false)),
            ],
            vec![],
        ),
        (
            "primed and delivering at once",
            vec![(1.0, report(true, TurnState::Delivering, true))],
            vec![NotePriming, MarkDelivering],
        ),
        ("a stop request", vec![(1.0, TurnEvent::StopRequested)], vec![Cancel]),
        (
            "the stop request a round later",
            vec![(1.0, TurnEvent::StopRequested), (1.25, TurnEvent::StopRequested)],
            vec![],
        ),
        (
            "the stop request two seconds later",
            vec![(1.0, TurnEvent::StopRequested), (3.0, TurnEvent::StopRequested)],
            vec![Cancel],
        ),
        ("the transcript's cap", vec![(1.0, limit())], vec![Cancel]),
        (
            "the transcript's cap again",
            vec![(1.0, limit()), (1.5, limit())],
            vec![],
        ),
        (
            "the vendor refused the key",
            vec![(1.0, rejected())],
            vec![
                FailNow((FailureCode::VendorAuthRejected, "401 from the vendor".into())),
                Cancel,
            ],
        ),
        (
            "the vendor refused again",
            vec![(1.0, rejected()), (2.0, rejected())],
            vec![],
        ),
        (
            "a silent driver",
            vec![(1.0, TurnEvent::DriverSilent { sandbox_exited: false })],
            vec![],
        ),
        (
            "a driver silent past the limit",
            vec![
                (1.0, TurnEvent::DriverSilent { sandbox_exited: false }),
                (4.0, TurnEvent::DriverSilent { sandbox_exited: false }),
            ],
            vec![Lose(Loss::SandboxGone)],
        ),
        (
            "a driver that answered again in between",
            vec![
                (1.0, TurnEvent::DriverSilent { sandbox_exited: false }),
                (2.0, running()),
                (4.0, TurnEvent::DriverSilent { sandbox_exited: false }),
            ],
            vec![],
        ),
        (
            "an exited sandbox",
            vec![(1.0, TurnEvent::DriverSilent { sandbox_exited: true })],
            vec![Lose(Loss::SandboxGone)],
        ),
        (
            "a broken stream, the driver alive",
            vec![(1.0, TurnEvent::RecorderBroke { driver_alive: true })],
            vec![FollowAgain],
        ),
        (
            "a broken stream, the driver gone",
            vec![(1.0, TurnEvent::RecorderBroke { driver_alive: false })],
            vec![Lose(Loss::SandboxGone)],
        ),
        (
            "a stream that keeps breaking",
            (0..=BREAKS_MAX)
                .map(|i| (1.0 + f64::from(i), TurnEvent::RecorderBroke { driver_alive: true }))
                .collect(),
            vec![Lose(Loss::StreamKeptBreaking)],
        ),
        (
            "the turn timeout by the host's clock",
            vec![(60.0, running())],
            vec![Cancel],
        ),
        (
            "past the timeout, once canceled",
            vec![(60.0, running()), (61.0, running())],
            vec![],
        ),
        (
            "past the timeout and its grace",
            vec![(60.0 + 180.0, running())],
            vec![Lose(Loss::GaveUp)],
        ),
    ];
    for (what, events, expected) in table {
        let started = Instant::now();
        let mut watch = TurnWatch::new(started, TIMEOUT);
        let mut last = Vec::new();
        for (secs, event) in events {
            let ticked = tick(&mut watch, started, secs);
            last = match event {
                // A tick is its own event: its actions are what it does.
                TurnEvent::Tick { .. } => ticked,
                event => [ticked, watch.step(event)].concat(),
            };
        }
        assert_eq!(last, expected, "{what}");
    }
}

#[test]
fn what_the_host_saw_is_kept_for_the_settlement() {
    let started = Instant::now();
    let mut watch = TurnWatch::new(started, TIMEOUT);
    tick(&mut watch, started, 1.0);
    watch.step(TurnEvent::TranscriptLimit("too large".into()));
    watch.step(TurnEvent::VendorRejected("refused".into()));
    let stopped = watch.step(TurnEvent::BudgetExceeded("over budget".into()));
    assert_eq!(
        stopped,
        vec![TurnAction::Cancel],
        "the turn stops, to deliver what it did"
    );
    assert_eq!(
        watch.step(TurnEvent::BudgetExceeded("again".into())),
        Vec::new(),
        "once"
    );
    tick(&mut watch, started, 61.0);
    assert_eq!(
        watch.seen,
        Seen {
            timed_out: true,
            limited: Some("too large".into()),
            rejected: Some("refused".into()),
            over_budget: Some("over budget".into()),
            delivering: false,
        }
    );
}
