//! Quota windows under a controlled clock.

use super::*;
use proptest::prelude::*;

const S: Duration = Duration::from_secs(1);

fn tenant(name: &str) -> Subject {
    Subject::Tenant(Arc::from(name))
}

fn limits(rpm: Option<u64>, tpm: Option<u64>, concurrent: Option<u32>) -> QuotaLimits {
    QuotaLimits {
        requests_per_minute: rpm,
        tokens_per_minute: tpm,
        tokens: TokenKind::Total,
        max_concurrent: concurrent,
    }
}

fn cost(prompt: u64, output: u64) -> TokenEstimate {
    TokenEstimate {
        prompt,
        output,
        output_asked: true,
    }
}

fn used(prompt: u64, completion: u64) -> TokenUsage {
    TokenUsage {
        prompt,
        completion,
        cached: 0,
        cache_said: false,
    }
}

#[test]
fn requests_per_minute_slide_with_the_clock() {
    let t0 = Instant::now();
    let mut q = QuotaBook::default();
    let who = [(tenant("a"), limits(Some(3), None, None))];
    for i in 0..3 {
        q.reserve(&who, cost(1, 1), t0 + i * 10 * S).unwrap();
    }
    let e = q.reserve(&who, cost(1, 1), t0 + 30 * S).unwrap_err();
    assert_eq!(e.limit, Limit::Requests);
    // The first leaves the window at 60 s: 30 s from now.
    assert_eq!(e.retry_after, 30 * S);
    assert_eq!(e.status.requests.unwrap().remaining, 0);
    assert!(q.reserve(&who, cost(1, 1), t0 + 59 * S).is_err());
    let (_, status) = q.reserve(&who, cost(1, 1), t0 + 60 * S).unwrap();
    assert_eq!(status.requests.unwrap().remaining, 0);
    assert_eq!(status.requests.unwrap().limit, 3);
}

#[test]
fn tokens_per_minute_admit_while_below_and_settle_to_usage() {
    let t0 = Instant::now();
    let mut q = QuotaBook::default();
    let who = [(tenant("a"), limits(None, Some(10_000), None))];
    // 3,000 each: four go (the fourth takes it to 12,000), the fifth waits.
    let mut held = Vec::new();
    for i in 0..4 {
        let (r, status) = q.reserve(&who, cost(2_000, 1_000), t0 + i * S).unwrap();
        held.push(r);
        assert_eq!(
            status.tokens.unwrap().remaining,
            10_000u64.saturating_sub(3_000 * (i as u64 + 1))
        );
    }
    let e = q.reserve(&who, cost(1, 1), t0 + 4 * S).unwrap_err();
    assert_eq!(e.limit, Limit::Tokens);
    // Below 10,000 once the first left the window: at 60 s.
    assert_eq!(e.retry_after, 56 * S);
    // The answers used 500 each: the window has room again at once.
    for r in &held {
        q.settle(r, used(400, 100), t0 + 5 * S);
    }
    let (_, status) = q.reserve(&who, cost(1_000, 0), t0 + 5 * S).unwrap();
    assert_eq!(status.tokens.unwrap().remaining, 10_000 - 2_000 - 1_000);
    // An answer longer than its estimate is charged in full.
    let (r, _) = q.reserve(&who, cost(10, 10), t0 + 6 * S).unwrap();
    q.settle(&r, used(10, 9_000), t0 + 7 * S);
    assert_eq!(
        q.reserve(&who, cost(1, 1), t0 + 7 * S).unwrap_err().limit,
        Limit::Tokens
    );
}

#[test]
fn token_kinds_count_input_output_or_both() {
    let e = cost(700, 300);
    let u = used(600, 50);
    assert_eq!(
        (TokenKind::Input.estimated(&e), TokenKind::Input.used(&u)),
        (700, 600)
    );
    assert_eq!(
        (TokenKind::Output.estimated(&e), TokenKind::Output.used(&u)),
        (300, 50)
    );
    assert_eq!(
        (TokenKind::Total.estimated(&e), TokenKind::Total.used(&u)),
        (1_000, 650)
    );
}

#[test]
fn concurrency_is_held_until_the_answer_ends() {
    let t0 = Instant::now();
    let mut q = QuotaBook::default();
    let who = [(tenant("a"), limits(None, None, Some(2)))];
    let (a, _) = q.reserve(&who, cost(1, 1), t0).unwrap();
    let (_b, _) = q.reserve(&who, cost(1, 1), t0).unwrap();
    let e = q.reserve(&who, cost(1, 1), t0).unwrap_err();
    assert_eq!((e.limit, e.retry_after), (Limit::Concurrency, S));
    q.settle(&a, used(1, 1), t0);
    q.reserve(&who, cost(1, 1), t0).unwrap();
}

#[test]
fn a_refusal_by_one_subject_takes_nothing_from_the_others() {
    let t0 = Instant::now();
    let mut q = QuotaBook::default();
    let key = (Subject::Key(Arc::from("k")), limits(Some(1), None, None));
    let acme = (tenant("acme"), limits(Some(2), None, Some(5)));
    q.reserve(&[acme.clone(), key.clone()], cost(1, 1), t0)
        .unwrap();
    let e = q
        .reserve(&[acme.clone(), key.clone()], cost(1, 1), t0)
        .unwrap_err();
    assert_eq!(e.subject, key.0);
    // The tenant's second request is still free for another key.
    let other = (Subject::Key(Arc::from("k2")), limits(Some(1), None, None));
    q.reserve(&[acme.clone(), other], cost(1, 1), t0).unwrap();
    assert_eq!(
        q.reserve(&[acme], cost(1, 1), t0).unwrap_err().limit,
        Limit::Requests
    );
}

#[test]
fn a_request_never_served_leaves_the_window() {
    let t0 = Instant::now();
    let mut q = QuotaBook::default();
    let who = [(tenant("a"), limits(Some(1), Some(100), Some(1)))];
    let (r, _) = q.reserve(&who, cost(50, 50), t0).unwrap();
    q.cancel(&r, t0 + S);
    let (_, status) = q.reserve(&who, cost(10, 0), t0 + S).unwrap();
    assert_eq!(status.requests.unwrap().remaining, 0);
    assert_eq!(status.tokens.unwrap().remaining, 90);
}

#[test]
fn reset_headers_read_like_openais() {
    assert_eq!(reset_header(Duration::from_millis(20)), "20ms");
    assert_eq!(reset_header(Duration::from_millis(1_000)), "1s");
    assert_eq!(reset_header(Duration::from_millis(59_200)), "1m0s");
    assert_eq!(reset_header(Duration::from_secs(360)), "6m0s");
    assert_eq!(reset_header(Duration::from_secs(61)), "1m1s");
}

#[test]
fn idle_subjects_are_forgotten_at_the_bound() {
    let t0 = Instant::now();
    let mut q = QuotaBook::default();
    for i in 0..MAX_SUBJECTS {
        let who = [(tenant(&format!("t{i}")), limits(Some(5), None, None))];
        q.reserve(&who, cost(1, 1), t0).unwrap();
    }
    assert_eq!(q.states.len(), MAX_SUBJECTS);
    // A minute later every window is empty: all are dropped for the new one.
    let who = [(tenant("late"), limits(Some(5), None, None))];
    q.reserve(&who, cost(1, 1), t0 + 61 * S).unwrap();
    assert_eq!(q.states.len(), 1);
}

proptest! {
    /// Whatever arrives and however the answers settle, no sliding minute
    /// admits more tokens than the quota plus one request's estimate, nor
    /// more requests than the requests-per-minute.
    #[test]
    fn no_minute_exceeds_its_quota(
        arrivals in proptest::collection::vec((0u64..2_000, 1u64..3_000, 0u64..3_000, any::<bool>()), 1..300)
    ) {
        const TPM: u64 = 10_000;
        const RPM: u64 = 40;
        let t0 = Instant::now();
        let mut q = QuotaBook::default();
        let who = [(tenant("a"), limits(Some(RPM), Some(TPM), None))];
        let mut at = t0;
        // (admitted at, tokens it finally counted)
        let mut admitted: Vec<(Instant, u64, u64)> = Vec::new();
        for (gap_ms, estimate, actual, settle) in arrivals {
            at += Duration::from_millis(gap_ms);
            if let Ok((r, _)) = q.reserve(&who, cost(estimate, 0), at) {
                let counted = if settle {
                    q.settle(&r, used(actual, 0), at);
                    actual
                } else {
                    estimate
                };
                admitted.push((at, estimate, counted));
            }
        }
        let max_estimate = admitted.iter().map(|a| a.1).max().unwrap_or(0);
        for (i, &(start, _, _)) in admitted.iter().enumerate() {
            let in_minute: Vec<_> = admitted[i..].iter().take_while(|a| a.0 < start + WINDOW).collect();
            let tokens: u64 = in_minute.iter().map(|a| a.2).sum();
            prop_assert!(in_minute.len() as u64 <= RPM);
            prop_assert!(tokens <= TPM + max_estimate.max(3_000), "{} tokens in a minute", tokens);
        }
    }
}

#[test]
fn a_request_answers_to_its_tenant_and_its_key() {
    let mut rules = QuotaRules::default();
    let acme = limits(Some(10), None, None);
    rules.tenants.insert("acme".into(), acme);
    let t = |n: &str| Arc::<str>::from(n);
    let key_limits = limits(None, Some(500), None);
    let subjects = rules.subjects(&t("acme"), Some((&t("k1"), &key_limits)));
    assert_eq!(
        subjects,
        [(tenant("acme"), acme), (Subject::Key(t("k1")), key_limits)]
    );
    // No default: other tenants are free; an empty key quota is none.
    assert!(rules
        .subjects(&t("other"), Some((&t("k1"), &QuotaLimits::default())))
        .is_empty());
    let fallback = limits(None, Some(1000), Some(2));
    rules.default_tenant = Some(fallback);
    assert_eq!(
        rules.subjects(&t("other"), None),
        [(tenant("other"), fallback)]
    );
}

#[test]
fn an_absurd_usage_cannot_overflow_a_window() {
    let t0 = Instant::now();
    let mut q = QuotaBook::default();
    let who = [(tenant("a"), limits(None, Some(10), None))];
    let (r, _) = q.reserve(&who, cost(1, 1), t0).unwrap();
    q.settle(&r, used(u64::MAX, u64::MAX), t0);
    let e = q.reserve(&who, cost(1, 1), t0).unwrap_err();
    assert_eq!(e.limit, Limit::Tokens);
    // It leaves the window like any other.
    q.reserve(&who, cost(1, 1), t0 + 60 * S).unwrap();
}
