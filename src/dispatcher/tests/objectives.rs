//! Latency objectives in the queues: earliest first token due first inside
//! a flow, fairness between flows as before, and sheddable work that no
//! endpoint can serve in time refused at once.

use super::*;
use crate::objective::Objective;

fn with_ttft(tenant: &str, priority: i32, ttft_ms: Option<u32>) -> RequestMeta {
    let mut r = req(tenant, priority);
    r.route.objective = Objective {
        ttft_ms,
        tpot_ms: None,
    };
    r
}

#[test]
fn inside_a_flow_the_earliest_due_goes_first_and_flows_still_take_turns() {
    let t0 = Instant::now();
    let mut d = Dispatcher::new(round_robin(30));
    d.report(report("a", "127.0.0.1:1", 1), t0).unwrap();
    let running = ready(d.submit(anon(), "running", t0));
    for (name, ttft) in [
        ("a1", None),
        ("a2", None),
        ("a3", Some(1_000)),
        ("a4", Some(200)),
    ] {
        queued(d.submit(with_ttft("a", 0, ttft), name, t0));
    }
    for name in ["b1", "b2"] {
        queued(d.submit(with_ttft("b", 0, None), name, t0 + MS));
    }
    assert_eq!(
        serve_one_by_one(&mut d, running, 6),
        ["a4", "b1", "a3", "b2", "a1", "a2"],
        "a's objectives first, earliest due first; then a's others in arrival order"
    );
}

#[test]
fn without_objectives_the_order_is_what_it_was() {
    let t0 = Instant::now();
    let mut d = Dispatcher::new(round_robin(30));
    d.report(report("a", "127.0.0.1:1", 1), t0).unwrap();
    let running = ready(d.submit(anon(), "running", t0));
    for (i, name) in ["a1", "a2", "a3"].into_iter().enumerate() {
        queued(d.submit(with_ttft("a", 0, None), name, t0 + MS * i as u32));
    }
    assert_eq!(serve_one_by_one(&mut d, running, 3), ["a1", "a2", "a3"]);
}

#[test]
fn sheddable_work_out_of_reach_is_refused_at_once_and_other_work_waits() {
    let t0 = Instant::now();
    let mut d = dispatcher(30);
    d.report(report("a", "127.0.0.1:1", 1), t0).unwrap();
    // The engine's prior: 20 ms an output token. A 5 ms objective is out
    // of reach on the free endpoint.
    let mut hurried = req("batch", -1);
    hurried.route.objective = Objective {
        ttft_ms: None,
        tpot_ms: Some(5),
    };
    assert_eq!(
        rejected(d.submit(hurried.clone(), "tpot", t0)),
        Reject::ObjectiveUnmet
    );
    assert_eq!(Reject::ObjectiveUnmet.http_status(), 429);
    // Not sheddable: served, late if it must.
    let mut chat = hurried.clone();
    chat.flow.priority = 0;
    let running = ready(d.submit(chat, "chat", t0));
    // Saturated: a sheddable request whose first token is due before a
    // slot frees (a second's service, by the prior) is refused now...
    assert_eq!(
        rejected(d.submit(with_ttft("batch", -1, Some(50)), "ttft", t0)),
        Reject::ObjectiveUnmet
    );
    // ... one with time to wait, and one that is not sheddable, wait.
    queued(d.submit(with_ttft("batch", -1, Some(60_000)), "patient", t0));
    queued(d.submit(with_ttft("chat", 0, Some(50)), "late", t0));
    d.release(running, t0);
    let done = d.dispatch(t0);
    assert_eq!(granted(&done), ["late"]);
}

#[test]
fn with_no_server_to_predict_from_sheddable_work_waits_as_any_request() {
    let t0 = Instant::now();
    let mut d = dispatcher(30);
    // No agent yet (scale from zero): nothing to predict a miss from.
    queued(d.submit(with_ttft("batch", -1, Some(50)), "early", t0));
    d.report(report("a", "127.0.0.1:1", 1), t0).unwrap();
    let done = d.dispatch(t0);
    assert_eq!(granted(&done), ["early"], "served once a server came");
}
