//! Latency objectives end to end: a bad header's 400, sheddable work out of
//! reach refused at once, an interactive request overtaking queued work of
//! its flow, and a server that slows down no longer chosen for a tight
//! objective.

mod common;

use std::time::{Duration, Instant};

use common::*;

/// A config where the `batch` objective is sheddable (priority −1).
fn config() -> ConfigFile {
    ConfigFile::new("objectives:\n  batch: -1\n")
}

#[tokio::test]
async fn a_bad_objective_header_is_a_400_naming_it() {
    let config = config();
    let (b, _sim, _agent) = fleet(&["--config", config.arg()], &["--slots", "1"]).await;
    b.wait_eligible(1).await;
    for (header, value) in [
        ("x-slo-ttft-ms", "0"),
        ("x-slo-ttft-ms", "fast"),
        ("x-slo-tpot-ms", "-5"),
        ("x-llm-d-slo-tpot-ms", "3600001"),
        ("x-slo-ttft-ms", "1.5"),
    ] {
        let resp = chat(&b, &[(header, value)]).await;
        let body = assert_openai_error(resp, 400).await;
        let message = body["error"]["message"].as_str().unwrap();
        assert!(message.contains(header), "{header}: {value}: {message}");
    }
    // Good values are served.
    let resp = chat(
        &b,
        &[("x-slo-ttft-ms", "60000"), ("x-llm-d-slo-tpot-ms", "1000")],
    )
    .await;
    assert_eq!(resp.status(), 200);
}

#[tokio::test]
async fn sheddable_work_that_cannot_be_served_in_time_gets_its_429_at_once() {
    let config = config();
    let (b, sim, _agent) = fleet(&["--config", config.arg()], &["--slots", "1"]).await;
    b.wait_eligible(1).await;
    // The only slot is busy for a few seconds.
    let busy = spawn_chat(&b, &[("x-sim-ttft-ms", "3000")]);
    b.wait_in_flight(1, Duration::from_secs(10)).await;
    let sent = Instant::now();
    let resp = chat(
        &b,
        &[
            ("x-gateway-inference-objective", "batch"),
            ("x-slo-ttft-ms", "100"),
        ],
    )
    .await;
    let waited = sent.elapsed();
    assert_eq!(
        resp.headers()["x-flowgate-drop-reason"],
        "objective-unmet",
        "{:?}",
        resp.headers()
    );
    assert_eq!(resp.headers()["retry-after"], "1");
    let body = assert_openai_error(resp, 429).await;
    assert_eq!(body["error"]["code"], "objective_unmet");
    assert!(
        waited < Duration::from_secs(1),
        "refused at once, not after the busy request ({waited:?})"
    );
    // The same objective at priority 0 is not sheddable: it waits and is
    // served, late.
    let late = spawn_chat(&b, &[("x-slo-ttft-ms", "100")]);
    assert_eq!(busy.await.unwrap(), 200);
    assert_eq!(late.await.unwrap(), 200);
    // Counted once its answer ended (after the client has it).
    wait_for(
        "the late one counted as a miss",
        Duration::from_secs(5),
        || async {
            let missed = metric(
                &b,
                "flowgate_objective_requests_total",
                &[("part", "ttft"), ("result", "missed")],
            )
            .await;
            (missed == 1.0).then_some(())
        },
    )
    .await;
    drop(sim);
}

#[tokio::test]
async fn an_interactive_request_overtakes_queued_work_of_its_flow_and_meets_its_objective() {
    let (b, sim, _agent) = fleet(&[], &["--slots", "1", "--ttft-ms", "300"]).await;
    b.wait_eligible(1).await;
    let running = spawn_chat(&b, &[("x-sim-tag", "running")]);
    b.wait_in_flight(1, Duration::from_secs(10)).await;
    let mut queued = Vec::new();
    for i in 0..3 {
        let tag = format!("batch-{i}");
        queued.push(tokio::spawn({
            let c = client();
            let url = b.url("/v1/chat/completions");
            async move {
                c.post(url)
                    .header("x-sim-tag", tag)
                    .json(&chat_body())
                    .send()
                    .await
                    .unwrap()
                    .status()
                    .as_u16()
            }
        }));
        b.wait_buffered(i + 1).await;
    }
    let sent = Instant::now();
    let resp = chat(
        &b,
        &[("x-sim-tag", "interactive"), ("x-slo-ttft-ms", "2000")],
    )
    .await;
    assert_eq!(resp.status(), 200);
    resp.bytes().await.unwrap();
    let took = sent.elapsed();
    assert_eq!(running.await.unwrap(), 200);
    for q in queued {
        assert_eq!(q.await.unwrap(), 200);
    }
    let arrivals = sim.stats().await["arrivals"].clone();
    assert_eq!(
        arrivals,
        serde_json::json!(["running", "interactive", "batch-0", "batch-1", "batch-2"]),
        "the interactive request went before the three queued ahead of it"
    );
    // It waited for the running request only, not for the three queued.
    assert!(took < Duration::from_millis(2000), "{took:?}");
    wait_for(
        "its objective counted as met",
        Duration::from_secs(5),
        || async {
            let met = metric(
                &b,
                "flowgate_objective_requests_total",
                &[("part", "ttft"), ("result", "met")],
            )
            .await;
            let goodput = metric(&b, "flowgate_objective_goodput_total", &[]).await;
            (met == 1.0 && goodput == 1.0).then_some(())
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_slows_down_stops_being_chosen_for_a_tight_objective() {
    let b = Balancer::start(&[]).await;
    let args = ["--slots", "4", "--tpot-ms", "5", "--ttft-ms", "5"];
    let mut sims = vec![Sim::start(&args), Sim::start(&args)];
    let _agents = [agent(&sims[0], &b), agent(&sims[1], &b)];
    b.wait_eligible(2).await;
    // Streams (their answers teach each server's time per token), two at
    // a time: the scorers spread them over both servers.
    let pairs = |tag: &'static str, headers: &'static [(&'static str, &'static str)], n: usize| {
        let url = b.url("/v1/chat/completions");
        async move {
            let c = client();
            let send = || {
                let mut req = c
                    .post(&url)
                    .header("x-sim-tag", tag)
                    .json(&serde_json::json!({
                    "model": "sim-model", "stream": true,
                    "stream_options": {"include_usage": true},
                    "messages": [{"role": "user", "content": "hi"}]}));
                for (k, v) in headers {
                    req = req.header(*k, *v);
                }
                async move {
                    let r = req.send().await.unwrap();
                    assert_eq!(r.status(), 200);
                    r.bytes().await.unwrap();
                }
            };
            for _ in 0..n {
                tokio::join!(send(), send());
            }
        }
    };
    const TIGHT: &[(&str, &str)] = &[("x-slo-tpot-ms", "20")];
    // Both answer at 5 ms a token: a 20 ms objective goes to either.
    pairs("warm", &[], 16).await;
    pairs("tight-before", TIGHT, 8).await;
    let before = tagged_per_server(&sims, "tight-before").await;
    assert!(before.iter().all(|&n| n > 0), "{before:?}");
    // The second server slows down to 60 ms a token (restarted where it
    // was, its agent polling the same address).
    let slow_addr = sims[1].addr.to_string();
    drop(sims.pop());
    sims.push(Sim::start_at(
        &slow_addr,
        &["--slots", "4", "--tpot-ms", "60", "--ttft-ms", "5"],
    ));
    b.wait_eligible(2).await;
    // Plain traffic goes to both, and its answers show the slowdown.
    pairs("plain", &[], 24).await;
    let plain = tagged_per_server(&sims, "plain").await;
    assert!(
        plain[1] >= 8,
        "the slow server still gets plain work: {plain:?}"
    );
    pairs("tight-after", TIGHT, 8).await;
    let after = tagged_per_server(&sims, "tight-after").await;
    assert_eq!(after, [16, 0], "a 20 ms objective avoids the 60 ms server");
}
