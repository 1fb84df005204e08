//! Table tests of a turn's settlement: every ending, and the pull request step.

use sortie_protocol::driver::{DeliveryReport, TurnFailure};

use super::*;

fn report(state: TurnState) -> TurnReport {
    TurnReport {
        n: 1,
        nonce: "00".into(),
        state,
        stop_reason: None,
        failure: None,
        parts: 0,
        priming: None,
        load_error: None,
        delivery: None,
    }
}

fn failed_report(code: DriverFailureCode, reason: &str) -> TurnReport {
    TurnReport {
        failure: Some(TurnFailure {
            code,
            reason: reason.into(),
        }),
        ..report(TurnState::Failed)
    }
}

fn delivery_error(code: DriverFailureCode) -> TurnReport {
    let delivery = DeliveryReport {
        error: Some(TurnFailure {
            code,
            reason: "the push was refused".into(),
        }),
        ..DeliveryReport::default()
    };
    TurnReport {
        delivery: Some(delivery),
        ..report(TurnState::Completed)
    }
}

/// The case, the driver's report, the stop request, what the host established; the ending's status and code.
type Row = (
    &'static str,
    TurnReport,
    Option<StopRequest>,
    Established,
    (TurnStatus, Option<FailureCode>),
);

fn host() -> Established {
    Established {
        seen: Seen::default(),
        delivery_failure: None,
        disk_full: None,
        head: None,
        turn_timeout: Duration::from_secs(60),
    }
}

fn code(ending: &TurnOutcome) -> (TurnStatus, Option<FailureCode>) {
    (ending.status, ending.failure.as_ref().map(|(code, _)| *code))
}

#[test]
fn every_ending() {
    use FailureCode as F;
    use TurnStatus as S;
    let rejected = || Seen {
        rejected: Some("the key was refused".into()),
        ..Seen::default()
    };
    let timed_out = || Seen {
        timed_out: true,
        ..Seen::default()
    };
    let limited = || Seen {
        limited: Some("the transcript is full".into()),
        ..Seen::default()
    };
    let over_budget = || Seen {
        over_budget: Some("500 of 500 tokens".into()),
        ..Seen::default()
    };
    let secret = || Some((F::SecretDetected, "a key in the diff".to_owned()));
    let full = || Some("the disk is full".to_owned());
    let table: Vec<Row> = vec![
        (
            "completed",
            report(TurnState::Completed),
            None,
            host(),
            (S::Completed, None),
        ),
        (
            "the agent stopped on a stop",
            report(TurnState::Cancelled),
            Some(StopRequest::Stop),
            host(),
            (S::Stopped, None),
        ),
        (
            "stopped for an interrupt",
            report(TurnState::Cancelled),
            Some(StopRequest::Interrupt),
            host(),
            (S::Stopped, None),
        ),
        (
            "finished before the stop reached it",
            report(TurnState::Completed),
            Some(StopRequest::Stop),
            host(),
            (S::Completed, None),
        ),
        (
            "a stop, the state unknown",
            report(TurnState::Delivering),
            Some(StopRequest::Stop),
            host(),
            (S::Stopped, None),
        ),
        (
            "canceled",
            report(TurnState::Completed),
            Some(StopRequest::Cancel),
            host(),
            (S::Canceled, None),
        ),
        (
            "the agent's error",
            failed_report(DriverFailureCode::AgentError, "it crashed"),
            None,
            host(),
            (S::Failed, Some(F::AgentError)),
        ),
        (
            "the driver's cancel is no failure",
            failed_report(DriverFailureCode::Canceled, "canceled"),
            Some(StopRequest::Stop),
            host(),
            (S::Stopped, None),
        ),
        (
            "the driver's delivery error",
            delivery_error(DriverFailureCode::PushConflict),
            None,
            host(),
            (S::Failed, Some(F::PushConflict)),
        ),
        (
            "the budget, though the driver calls it canceled",
            report(TurnState::Cancelled),
            None,
            Established {
                seen: over_budget(),
                ..host()
            },
            (S::Failed, Some(F::BudgetExceeded)),
        ),
        (
            "the budget before a cap",
            report(TurnState::Cancelled),
            None,
            Established {
                seen: Seen {
                    over_budget: Some("over".into()),
                    ..limited()
                },
                ..host()
            },
            (S::Failed, Some(F::BudgetExceeded)),
        ),
        (
            "the vendor's refusal first",
            failed_report(DriverFailureCode::AgentError, "401"),
            None,
            Established {
                seen: rejected(),
                ..host()
            },
            (S::Failed, Some(F::VendorAuthRejected)),
        ),
        (
            "the host's timeout before a cap",
            report(TurnState::Cancelled),
            None,
            Established {
                seen: Seen {
                    timed_out: true,
                    ..limited()
                },
                ..host()
            },
            (S::Failed, Some(F::TurnTimeout)),
        ),
        (
            "the host's timeout, though the driver calls it canceled",
            report(TurnState::Cancelled),
            None,
            Established {
                seen: timed_out(),
                ..host()
            },
            (S::Failed, Some(F::TurnTimeout)),
        ),
        (
            "the transcript's cap",
            report(TurnState::Cancelled),
            None,
            Established {
                seen: limited(),
                ..host()
            },
            (S::Failed, Some(F::AgentError)),
        ),
        (
            "the host's delivery failure over the driver's",
            delivery_error(DriverFailureCode::PushConflict),
            None,
            Established {
                delivery_failure: secret(),
                ..host()
            },
            (S::Failed, Some(F::SecretDetected)),
        ),
        (
            "a full disk explains the agent's error",
            failed_report(DriverFailureCode::AgentError, "ENOSPC"),
            None,
            Established {
                disk_full: full(),
                ..host()
            },
            (S::Failed, Some(F::DiskQuotaExceeded)),
        ),
        (
            "a full disk explains a failed delivery",
            delivery_error(DriverFailureCode::DeliveryFailed),
            None,
            Established {
                disk_full: full(),
                ..host()
            },
            (S::Failed, Some(F::DiskQuotaExceeded)),
        ),
        (
            "a full disk fails a turn that said it completed",
            report(TurnState::Completed),
            None,
            Established {
                disk_full: full(),
                ..host()
            },
            (S::Failed, Some(F::DiskQuotaExceeded)),
        ),
        (
            "a full disk explains no timeout",
            report(TurnState::Cancelled),
            None,
            Established {
                disk_full: full(),
                seen: timed_out(),
                ..host()
            },
            (S::Failed, Some(F::TurnTimeout)),
        ),
        (
            "a failure wins over a cancel",
            failed_report(DriverFailureCode::AgentError, "it crashed"),
            Some(StopRequest::Cancel),
            host(),
            (S::Failed, Some(F::AgentError)),
        ),
    ];
    for (what, report, stop, host, expected) in table {
        assert_eq!(code(&ending(&report, stop, host)), expected, "{what}");
    }
}

#[test]
fn the_host_bounds_the_drivers_reason_and_keeps_the_head() {
    let long = "x".repeat(DRIVER_REASON_MAX_BYTES * 2);
    let ended = ending(
        &failed_report(DriverFailureCode::AgentError, &long),
        None,
        Established {
            head: Some("abc".into()),
            ..host()
        },
    );
    let (_, reason) = ended.failure.expect("a failure");
    assert!(
        reason.len() <= DRIVER_REASON_MAX_BYTES + '…'.len_utf8(),
        "{}",
        reason.len()
    );
    assert_eq!(ended.head_sha.as_deref(), Some("abc"));
}

#[test]
fn the_pull_request_step() {
    let id = SessionId::generate();
    let completed = || ending(&report(TurnState::Completed), None, host());
    let failed = ending(&failed_report(DriverFailureCode::AgentError, "no"), None, host());
    let canceled = ending(&report(TurnState::Completed), Some(StopRequest::Cancel), host());
    assert!(opens_pull_request(&completed(), true, false));
    assert!(!opens_pull_request(&completed(), false, false), "nothing on the remote");
    assert!(!opens_pull_request(&completed(), true, true), "the session has one");
    assert!(!opens_pull_request(&failed, true, false));
    assert!(!opens_pull_request(&canceled, true, false));

    let opened = PullRequest::Opened {
        url: "https://forge/o/r/pull/1".into(),
        number: 1,
    };
    assert_eq!(
        code(&after_pull_request(completed(), &opened, &id, None)),
        (TurnStatus::Completed, None)
    );
    let refused = after_pull_request(
        completed(),
        &PullRequest::Failed("the forge said 403".into()),
        &id,
        None,
    );
    assert_eq!(code(&refused), (TurnStatus::Failed, Some(FailureCode::PrOpenFailed)));
    let reason = refused.failure.map(|(_, reason)| reason).unwrap_or_default();
    assert!(
        reason.starts_with("the forge said 403. The work is on the branch sortie/"),
        "{reason}"
    );
    let stop = Some(StopRequest::Cancel);
    let failed_then_canceled = after_pull_request(completed(), &PullRequest::Failed("403".into()), &id, stop);
    assert_eq!(code(&failed_then_canceled), (TurnStatus::Canceled, None));
    let stopped = after_pull_request(completed(), &PullRequest::NotApplicable, &id, Some(StopRequest::Stop));
    assert_eq!(
        code(&stopped),
        (TurnStatus::Completed, None),
        "a stop after the agent finished changes nothing"
    );
}
