//! Several balancers, one fleet, as an operator runs them: one agent
//! reports to every balancer it is given (a list, or the flag repeated), a
//! balancer stopped with SIGSTOP delays none of the others' reports, a
//! balancer restarted on its port is re-populated within a report
//! interval, a draining agent leaves every balancer, and a balancer told to
//! stop turns its readiness off at once but serves through its drain delay;
//! a conversation spread over two balancers stays on one server; and the
//! agents divide each server's slots between the balancers, so the two
//! together never send a server more than its slots.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::*;

/// The report age of the only endpoint `b` knows, in milliseconds.
async fn report_age_ms(b: &Balancer) -> Option<u64> {
    b.agents().await["endpoints"][0]["report_age_ms"].as_u64()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_agent_reports_to_every_balancer_and_a_stopped_one_delays_none() {
    let one = Balancer::start(&[]).await;
    let two = Balancer::start(&[]).await;
    let sim = Sim::start(&["--slots", "2"]);
    // A comma-separated list.
    let list = format!("{},{}", one.management, two.management);
    let _agent = agent_at(&sim.addr.to_string(), &one, &["--management-addr", &list]);
    one.wait_eligible(1).await;
    two.wait_eligible(1).await;
    for b in [&one, &two] {
        assert_eq!(chat(b, &[]).await.status(), 200);
    }

    // The second balancer stops answering (its reports hang until the
    // agent's timeout); the first keeps getting every report.
    two.proc.signal("STOP");
    let until = Instant::now() + Duration::from_secs(3);
    let mut oldest = 0;
    while Instant::now() < until {
        oldest = oldest.max(report_age_ms(&one).await.unwrap_or(u64::MAX));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        oldest < 500,
        "a report to the live balancer waited {oldest} ms"
    );
    assert_eq!(chat(&one, &[]).await.status(), 200);
    two.proc.signal("CONT");
    wait_for(
        "the stopped balancer's reports again",
        Duration::from_secs(10),
        || async { (report_age_ms(&two).await? < 500).then_some(()) },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_balancer_is_repopulated_and_a_draining_agent_leaves_them_all() {
    let one = Balancer::start(&[]).await;
    let two = Balancer::start(&[]).await;
    let sim = Sim::start(&["--slots", "2"]);
    // The flag repeated.
    let agent = agent_at(
        &sim.addr.to_string(),
        &one,
        &["--management-addr", &two.management.to_string()],
    );
    one.wait_eligible(1).await;
    two.wait_eligible(1).await;

    // kill -9 the second balancer and start a new one where it was.
    let (inference, management): (SocketAddr, SocketAddr) = (two.inference, two.management);
    drop(two);
    let started = Instant::now();
    let two = Balancer::start_on(inference, management, &[]).await;
    two.wait_eligible(1).await;
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "re-populated {:?} after the restart",
        started.elapsed()
    );
    assert_eq!(chat(&two, &[]).await.status(), 200);

    // SIGTERM: the agent drains, then deregisters from both.
    agent.signal("TERM");
    for b in [&one, &two] {
        wait_for("the agent gone", Duration::from_secs(10), || async {
            b.agents().await["endpoints"]
                .as_array()
                .unwrap()
                .is_empty()
                .then_some(())
        })
        .await;
    }
}

/// GET `url`'s status, or 0 when nothing answers.
async fn status_of(url: &str) -> u16 {
    match client().get(url).send().await {
        Ok(r) => r.status().as_u16(),
        Err(_) => 0,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_turns_readiness_off_at_once_and_serves_through_the_drain_delay() {
    let (mut b, _sim, _agent) = fleet(&["--drain-delay", "1500ms"], &["--slots", "2"]).await;
    for path in ["/health", "/health/ready", "/health/live"] {
        assert_eq!(status_of(&b.url(path)).await, 200, "{path}");
    }
    assert_eq!(status_of(&b.mgmt("/ready")).await, 200);
    b.proc.signal("TERM");
    let sent = Instant::now();
    wait_for("readiness off", Duration::from_millis(500), || async {
        (status_of(&b.url("/health/ready")).await == 503).then_some(())
    })
    .await;
    assert_eq!(status_of(&b.url("/health")).await, 503);
    assert_eq!(status_of(&b.mgmt("/ready")).await, 503);
    assert_eq!(status_of(&b.url("/health/live")).await, 200, "alive");
    assert_eq!(status_of(&b.mgmt("/health")).await, 200, "alive");
    // Still accepting and serving, new connections included.
    let fresh = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    for _ in 0..3 {
        let r = chat_with(&fresh, &b, &[], chat_body()).await;
        assert_eq!(r.status(), 200);
    }
    assert!(
        sent.elapsed() < Duration::from_millis(1500),
        "served within the delay"
    );
    // After the delay the port closes and, nothing in flight, it exits.
    let status = tokio::task::block_in_place(|| b.proc.wait_exit(Duration::from_secs(6)))
        .expect("exits once the delay is over and nothing is left");
    assert!(status.success(), "{status:?}");
    assert!(
        sent.elapsed() >= Duration::from_millis(1500),
        "not before the delay"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_spread_over_two_balancers_stays_on_one_server() {
    let one = Balancer::start(&[]).await;
    let two = Balancer::start(&[]).await;
    let sims: Vec<Sim> = (0..3).map(|_| Sim::start(&["--slots", "4"])).collect();
    let both = format!("{},{}", one.management, two.management);
    let _agents: Vec<Proc> = sims
        .iter()
        .map(|s| agent_at(&s.addr.to_string(), &one, &["--management-addr", &both]))
        .collect();
    one.wait_eligible(3).await;
    two.wait_eligible(3).await;
    let c = client();
    for conv in 0..6 {
        let tag = format!("conv{conv}");
        for turn in 0..6 {
            // A front load balancer's round robin.
            let b = if turn % 2 == 0 { &one } else { &two };
            let body = chat_for(Some("sim-model"), &format!("{tag} turn {turn} ").repeat(30));
            let r = c
                .post(b.url("/v1/chat/completions"))
                .header("x-session-id", format!("key-{conv}"))
                .header("x-sim-tag", &tag)
                .json(&body)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            r.bytes().await.unwrap();
        }
        let counts = tagged_per_server(&sims, &tag).await;
        assert!(
            counts.contains(&6),
            "{tag} was split over the servers: {counts:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_balancers_never_send_a_server_more_than_its_slots() {
    let one = Balancer::start(&["--max-buffered-requests", "100"]).await;
    let two = Balancer::start(&["--max-buffered-requests", "100"]).await;
    // Slow answers: every slot stays taken long enough for both balancers
    // to want it.
    let sims: Vec<Sim> = (0..2)
        .map(|_| Sim::start(&["--slots", "2", "--ttft-ms", "150"]))
        .collect();
    let both = format!("{},{}", one.management, two.management);
    let _agents: Vec<Proc> = sims
        .iter()
        .map(|s| agent_at(&s.addr.to_string(), &one, &["--management-addr", &both]))
        .collect();
    one.wait_eligible(2).await;
    two.wait_eligible(2).await;
    // Each balancer was given a share of each server: together, the four
    // slots.
    let shares = |v: serde_json::Value| -> Vec<u64> {
        v["endpoints"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["agent"]["slot_share"].as_u64().unwrap_or(99))
            .collect()
    };
    wait_for("both balancers' shares", Duration::from_secs(5), || async {
        let (a, b) = (shares(one.agents().await), shares(two.agents().await));
        (a.iter().sum::<u64>() + b.iter().sum::<u64>() == 4).then_some(())
    })
    .await;
    // Twelve clients on each balancer, closed loop, 3 requests each: six
    // times what the four slots take.
    let c = client();
    let jobs: Vec<_> = (0..24)
        .map(|i| {
            let c = c.clone();
            let url = if i % 2 == 0 { &one } else { &two }.url("/v1/chat/completions");
            tokio::spawn(async move {
                let mut statuses = Vec::new();
                for n in 0..3 {
                    let body = chat_for(Some("sim-model"), &format!("client {i} request {n}"));
                    let r = c.post(&url).json(&body).send().await.unwrap();
                    statuses.push(r.status().as_u16());
                    r.bytes().await.unwrap();
                }
                statuses
            })
        })
        .collect();
    for j in jobs {
        assert_eq!(j.await.unwrap(), [200, 200, 200]);
    }
    // Without the shares, each balancer fills both slots of a server the
    // other also fills: the server queues the extra requests.
    for s in &sims {
        let stats = s.stats().await;
        assert!(stats["max_processing"].as_u64().unwrap() <= 2, "{stats}");
        assert_eq!(
            stats["max_deferred"], 0,
            "a server got more than its slots: {stats}"
        );
    }
}
