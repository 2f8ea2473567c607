//! A server busy with work no balancer sent: a client that bypasses the
//! balancers (a direct user, a batch script, another router) takes every
//! slot of one of two 4-slot servers. Once its agent reports it, the
//! balancers send their next requests to the free server, a session bound
//! to the busy one included, and the busy engine queues none of them:
//! with one balancer, and with two sharing both servers through the
//! agents' slot shares. When such clients fill every server, the
//! balancer keeps its requests until a slot frees.

mod common;

use std::time::Duration;

use common::*;

/// How long the bypassing client keeps the busy server's slots.
const FOREIGN_MS: &str = "4000";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_balancer_sends_nothing_to_a_server_a_bypassing_client_filled() {
    let b = Balancer::start(&[]).await;
    let sims: Vec<Sim> = (0..2).map(|_| Sim::start(&["--slots", "4"])).collect();
    let _agents: Vec<Proc> = sims.iter().map(|s| agent(s, &b)).collect();
    b.wait_eligible(2).await;
    requests_pass_the_filled_server(&sims, &[&b]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_balancers_send_nothing_to_a_server_a_bypassing_client_filled() {
    let one = Balancer::start(&[]).await;
    let two = Balancer::start(&[]).await;
    let sims: Vec<Sim> = (0..2).map(|_| Sim::start(&["--slots", "4"])).collect();
    let _agents = agents_for_both(sims.iter().map(|s| s.addr), &one, &two, &[]).await;
    requests_pass_the_filled_server(&sims, &[&one, &two]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_wait_in_the_balancer_while_bypassing_clients_fill_every_server() {
    let b = Balancer::start(&[]).await;
    let sims: Vec<Sim> = (0..2).map(|_| Sim::start(&["--slots", "2"])).collect();
    let _agents: Vec<Proc> = sims.iter().map(|s| agent(s, &b)).collect();
    b.wait_eligible(2).await;
    let direct: Vec<_> = sims.iter().flat_map(|s| bypass(s, 2, "1500")).collect();
    for s in &sims {
        wait_reported(&b, s, "slots_busy", 2, Duration::from_secs(5)).await;
    }
    // Nothing is free: the balancer keeps them until the clients' work ends.
    let mine: Vec<_> = (0..3).map(|_| spawn_chat(&b, &[])).collect();
    b.wait_buffered(3).await;
    for m in mine {
        assert_eq!(m.await.unwrap(), 200);
    }
    all_answered(direct).await;
    no_engine_queued(&sims).await;
}

/// A conversation's first turn goes to some server through the first of
/// `balancers`; a client then fills that server directly. The next turn
/// and three more requests, spread over `balancers`, all go to the other
/// server, and neither engine ever queues a request.
async fn requests_pass_the_filled_server(sims: &[Sim], balancers: &[&Balancer]) {
    let c = client();
    let turn = |b: &Balancer, n: usize| {
        c.post(b.url("/v1/chat/completions"))
            .header("x-session-id", "conv")
            .header("x-sim-tag", format!("turn-{n}"))
            .json(&chat_for(Some("sim-model"), &format!("turn {n}")))
            .send()
    };
    assert_eq!(turn(balancers[0], 0).await.unwrap().status(), 200);
    let counts = tagged_per_server(sims, "turn-0").await;
    let busy_i = counts.iter().position(|&n| n == 1).expect("turn 0 served");
    let busy = &sims[busy_i];

    // The bypassing client takes all four slots of the conversation's
    // server.
    let direct = bypass(busy, 4, FOREIGN_MS);
    wait_for("the engine busy", Duration::from_secs(5), || async {
        (busy.stats().await["processing"] == 4).then_some(())
    })
    .await;
    // Every balancer has a report that shows it.
    for b in balancers {
        wait_reported(b, busy, "slots_busy", 4, Duration::from_secs(5)).await;
    }

    // The conversation's next turn, and three requests without a key.
    let mut sent = vec![tokio::spawn(turn(balancers[balancers.len() - 1], 1))];
    for i in 0..3 {
        let b = balancers[i % balancers.len()];
        sent.push(tokio::spawn(
            c.post(b.url("/v1/chat/completions"))
                .header("x-sim-tag", "keyless")
                .json(&chat_for(Some("sim-model"), &format!("keyless {i}")))
                .send(),
        ));
    }
    for r in sent {
        assert_eq!(r.await.unwrap().unwrap().status(), 200);
    }
    assert_eq!(
        tagged_per_server(sims, "turn-1").await[busy_i],
        0,
        "the conversation's turn went to the server the client filled"
    );
    assert_eq!(
        tagged_per_server(sims, "keyless").await[busy_i],
        0,
        "a request went to the server the client filled"
    );
    // The agent's division counts the client's slots out of every
    // balancer's share, however idle the balancer.
    for b in balancers {
        wait_reported(b, busy, "slot_share", 0, Duration::from_secs(3)).await;
    }
    no_engine_queued(sims).await;
    all_answered(direct).await;
}

/// `n` requests sent straight to `sim`, bypassing the balancers, each
/// holding a slot `ttft_ms`: their statuses.
fn bypass(sim: &Sim, n: usize, ttft_ms: &str) -> Vec<tokio::task::JoinHandle<Option<u16>>> {
    let c = client();
    (0..n)
        .map(|i| {
            let r = c
                .post(format!("http://{}/v1/chat/completions", sim.addr))
                .header("x-sim-ttft-ms", ttft_ms)
                .json(&chat_for(Some("sim-model"), &format!("direct {i}")))
                .send();
            tokio::spawn(async move { r.await.map(|r| r.status().as_u16()).ok() })
        })
        .collect()
}

/// Waits, at most `within`, until `b`'s view of `sim`'s report has
/// `field` at `value`.
async fn wait_reported(b: &Balancer, sim: &Sim, field: &str, value: u64, within: Duration) {
    let what = format!("{field} {value} in a report of {}", sim.addr);
    wait_for(&what, within, || async {
        let agents = b.agents().await;
        (endpoint_of(&agents, sim)["agent"][field] == value).then_some(())
    })
    .await;
}

/// Every request sent past the balancers was answered 200.
async fn all_answered(direct: Vec<tokio::task::JoinHandle<Option<u16>>>) {
    for d in direct {
        assert_eq!(d.await.unwrap(), Some(200));
    }
}

/// No engine ever queued a request beyond its slots.
async fn no_engine_queued(sims: &[Sim]) {
    for s in sims {
        let stats = s.stats().await;
        assert_eq!(
            stats["max_deferred"], 0,
            "an engine queued a request: {stats}"
        );
    }
}
