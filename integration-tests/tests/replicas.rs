//! Several balancers, one fleet, as an operator runs them: one agent
//! reports to every balancer it is given (a list, or the flag repeated), a
//! balancer stopped with SIGSTOP delays none of the others' reports, a
//! balancer restarted on its port is re-populated within a report
//! interval, a draining agent leaves every balancer, and a balancer told to
//! stop turns its readiness off at once but serves through its drain delay;
//! a conversation spread over two balancers stays on one server, and one
//! that a balancer moved is followed by the other when they share their
//! session bindings through Redis (a hung Redis failing no turn); and the
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

/// Two balancers (`args` each) and `n` servers (`sim_args`) whose agents
/// report to both, every server eligible on both.
async fn two_balancers(
    args: &[&str],
    n: usize,
    sim_args: &[&str],
) -> (Balancer, Balancer, Vec<Sim>, Vec<Proc>) {
    let one = Balancer::start(args).await;
    let two = Balancer::start(args).await;
    let sims: Vec<Sim> = (0..n).map(|_| Sim::start(sim_args)).collect();
    let agents = agents_for_both(sims.iter().map(|s| s.addr), &one, &two, &[]).await;
    (one, two, sims, agents)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_spread_over_two_balancers_stays_on_one_server() {
    let (one, two, sims, _agents) = two_balancers(&[], 3, &["--slots", "4"]).await;
    for conv in 0..6 {
        // A front load balancer's round robin.
        let url = |turn: usize| if turn % 2 == 0 { &one } else { &two }.url("/v1/chat/completions");
        six_turns_stay_on_one_server(&sims, conv, url).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_balancers_never_send_a_server_more_than_its_slots() {
    // Slow answers: every slot stays taken long enough for both balancers
    // to want it.
    let (one, two, sims, _agents) = two_balancers(
        &["--max-buffered-requests", "100"],
        2,
        &["--slots", "2", "--ttft-ms", "150"],
    )
    .await;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_balancer_queueing_for_another_model_claims_no_slots_of_a_server() {
    // One 2-slot server per model; slow answers keep the queues full.
    let one = Balancer::start(&[]).await;
    let two = Balancer::start(&[]).await;
    let sims: Vec<Sim> = ["m1", "m2"]
        .iter()
        .map(|m| Sim::start(&["--model", m, "--slots", "2", "--ttft-ms", "300"]))
        .collect();
    let _agents = agents_for_both(sims.iter().map(|s| s.addr), &one, &two, &[]).await;
    // The first balancer queues for m1 twice as long as the second queues
    // for m2: m2's server owes the second balancer both its slots.
    let c = client();
    let load = |b: &Balancer, model: &'static str, n: usize| {
        let url = b.url("/v1/chat/completions");
        (0..n)
            .map(|i| {
                let r = c
                    .post(&url)
                    .json(&chat_for(Some(model), &format!("{model} {i}")))
                    .send();
                tokio::spawn(async move { r.await.map(|r| r.status().as_u16()).ok() })
            })
            .collect::<Vec<_>>()
    };
    let m1 = load(&one, "m1", 12);
    let m2 = load(&two, "m2", 6);
    for j in m2.into_iter().chain(m1) {
        assert_eq!(j.await.unwrap(), Some(200));
    }
    let stats = sims[1].stats().await;
    assert_eq!(
        stats["max_processing"], 2,
        "m2's server ran its requests one at a time: {stats}"
    );
    assert_eq!(stats["max_deferred"], 0, "{stats}");
}

/// Which of `sims` got the request tagged `tag`.
async fn server_of(sims: &[Sim], tag: &str) -> usize {
    let counts = tagged_per_server(sims, tag).await;
    counts
        .iter()
        .position(|&n| n == 1)
        .unwrap_or_else(|| panic!("{tag}: {counts:?}"))
}

/// The saturation `b` sees at the server `addr` (`null` when it takes
/// work).
async fn saturation_at(b: &Balancer, addr: &str) -> serde_json::Value {
    b.agents().await["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["addr"] == addr)
        .map(|e| e["saturation"].clone())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_moved_by_one_balancer_is_followed_by_the_other_through_redis() {
    a_moved_conversation_is_followed_through_redis(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyless_conversation_moved_by_one_balancer_is_followed_by_the_other_through_redis() {
    a_moved_conversation_is_followed_through_redis(false).await;
}

/// A conversation (`keyed`: with `x-session-id`; else named by its
/// prompts) that one balancer moves off its saturated server is followed
/// there by the other balancer, which sent it to the old one.
async fn a_moved_conversation_is_followed_through_redis(keyed: bool) {
    let redis = Redis::start().await;
    // A server with one request waiting takes no more work.
    let config = ConfigFile::new("saturationDetector:\n  queueDepthThreshold: 1\n");
    let args = [
        "--config",
        config.arg(),
        "--sessions-redis-url",
        redis.url.as_str(),
    ];
    let (one, two, sims, _agents) = two_balancers(&args, 3, &["--slots", "2"]).await;
    let c = client();
    let turn = |b: &Balancer, n: usize| {
        let r = c
            .post(b.url("/v1/chat/completions"))
            .header("x-sim-tag", format!("turn-{n}"));
        if keyed {
            r.header("x-session-id", "conv").json(&chat_for(
                Some("sim-model"),
                &format!("turn-{n} ").repeat(20),
            ))
        } else {
            r.json(&conversation_turn("sim-model", "conv", n))
        }
        .send()
    };
    // The first turn, through the first balancer: its home.
    assert_eq!(turn(&one, 0).await.unwrap().status(), 200);
    let home = server_of(&sims, "turn-0").await;
    let home_addr = sims[home].addr.to_string();
    // Other clients fill the home directly, one of them waiting there:
    // both balancers see it saturated.
    let direct: Vec<_> = (0..3)
        .map(|i| {
            c.post(format!("http://{home_addr}/v1/chat/completions"))
                .header("x-sim-ttft-ms", "1500")
                .json(&chat_for(Some("sim-model"), &format!("direct {i}")))
                .send()
        })
        .map(tokio::spawn)
        .collect();
    for b in [&one, &two] {
        wait_for("the home saturated", Duration::from_secs(5), || async {
            // Its slots taken by work no balancer sent (and its queue).
            (!saturation_at(b, &home_addr).await.is_null()).then_some(())
        })
        .await;
    }
    // The next turn reaches the second balancer: prefilling its short
    // prompt elsewhere beats waiting for the home, so it moves.
    assert_eq!(turn(&two, 1).await.unwrap().status(), 200);
    let moved = server_of(&sims, "turn-1").await;
    assert_ne!(moved, home, "the turn waited for its home");
    let moved_addr = sims[moved].addr.to_string();
    wait_for("the move shared", Duration::from_secs(5), || async {
        redis.session_bindings().contains(&moved_addr).then_some(())
    })
    .await;
    for d in direct {
        assert_eq!(d.await.unwrap().unwrap().status(), 200);
    }
    wait_for("the home free again", Duration::from_secs(5), || async {
        saturation_at(&one, &home_addr)
            .await
            .is_null()
            .then_some(())
    })
    .await;
    // The first balancer has the conversation at its home, free again (a
    // bound session, or the prompt in its prefix index); Redis says it
    // moved: the third turn follows it.
    assert_eq!(turn(&one, 2).await.unwrap().status(), 200);
    assert_eq!(
        server_of(&sims, "turn-2").await,
        moved,
        "the first balancer sent the conversation back to where it no longer is"
    );
    // A Redis that hangs is a hint gone, not an outage: turns go on, by
    // each balancer's own bindings, and the failures are counted.
    redis.signal("STOP");
    let started = Instant::now();
    for (i, b) in [&one, &two, &one].into_iter().enumerate() {
        let r = turn(b, 3 + i).await.unwrap();
        assert_eq!(r.status(), 200);
    }
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "three turns took {:?} with Redis hung",
        started.elapsed()
    );
    let lookups_failed = metric(
        &one,
        "flowgate_session_store_errors_total",
        &[("op", "lookup")],
    )
    .await;
    assert!(lookups_failed >= 1.0, "{lookups_failed}");
    redis.signal("CONT");
}
