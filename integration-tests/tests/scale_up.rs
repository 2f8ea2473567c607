//! Scale from zero: the unserved-demand gauge and the scale-up webhook.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use http_body_util::{BodyExt, Full};
use serde_json::{json, Value};

type Calls = Arc<Mutex<Vec<Value>>>;

/// An HTTP server on 127.0.0.1 that answers 200 and keeps the JSON bodies
/// POSTed to it; it stops with the test's runtime.
async fn webhook_receiver() -> (String, Calls) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    let calls: Calls = Arc::default();
    let kept = Arc::clone(&calls);
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let kept = Arc::clone(&kept);
            let service = hyper::service::service_fn(move |req: hyper::Request<_>| {
                let kept = Arc::clone(&kept);
                async move {
                    let body: hyper::body::Incoming = req.into_body();
                    let bytes = body.collect().await?.to_bytes();
                    let value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
                    kept.lock().unwrap().push(value);
                    Ok::<_, hyper::Error>(hyper::Response::new(Full::new(bytes::Bytes::new())))
                }
            });
            tokio::spawn(
                hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service),
            );
        }
    });
    (url, calls)
}

/// Requests for a model no server serves wait, show in
/// `flowgate_unserved_demand_requests`, and call the webhook once per
/// interval; when a server for the model comes up they are served and the
/// gauge drops to 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unserved_demand_calls_the_scale_up_webhook_once_per_interval() {
    let (hook, calls) = webhook_receiver().await;
    let b = Balancer::start(&[
        "--scale-up-webhook",
        &hook,
        "--scale-up-webhook-interval",
        "60s",
        "--buffered-request-timeout",
        "30000",
    ])
    .await;
    let send = || {
        let url = b.url("/v1/chat/completions");
        tokio::spawn(async move {
            let resp = client()
                .post(url)
                .json(&chat_for(Some("m1"), "hello"))
                .send()
                .await
                .unwrap();
            resp.status().as_u16()
        })
    };
    let first = send();
    b.wait_buffered(1).await;
    wait_for("the webhook call", Duration::from_secs(5), || async {
        (!calls.lock().unwrap().is_empty()).then_some(())
    })
    .await;
    assert_eq!(
        calls.lock().unwrap()[0],
        json!({"event": "scale_up", "model": "m1", "queued_requests": 1})
    );
    let second = send();
    b.wait_buffered(2).await;
    let unserved = || metric(&b, "flowgate_unserved_demand_requests", &[("model", "m1")]);
    assert_eq!(unserved().await, 2.0);
    assert_eq!(
        b.agents().await["unserved_demand"],
        json!([{"model": "m1", "requests": 2}])
    );

    let sim = Sim::start(&["--slots", "2", "--model", "m1"]);
    let _agent = agent(&sim, &b);
    assert_eq!(first.await.unwrap(), 200);
    assert_eq!(second.await.unwrap(), 200);
    assert_eq!(unserved().await, 0.0);
    assert_eq!(calls.lock().unwrap().len(), 1, "one call per 60 s interval");
    assert_eq!(
        metric(&b, "flowgate_scale_up_webhooks_total", &[("result", "ok")]).await,
        1.0
    );
}
