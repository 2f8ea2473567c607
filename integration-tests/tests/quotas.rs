//! Quotas per tenant and per API key (README "Quotas"): 429
//! `quota_exceeded` with `Retry-After` and OpenAI's `x-ratelimit-*`
//! headers, settled to what the answers used, and shared by two balancers
//! through a real redis-server.

mod common;

use std::time::Duration;

use common::*;
use serde_json::Value;

async fn send(b: &Balancer, key: Option<&str>, tenant: &str, body: Value) -> reqwest::Response {
    let mut req = client()
        .post(b.url("/v1/chat/completions"))
        .header("x-gateway-inference-fairness-id", tenant)
        .json(&body);
    if let Some(key) = key {
        req = req.bearer_auth(key);
    }
    req.send().await.expect("the balancer answers")
}

fn header<'a>(r: &'a reqwest::Response, name: &str) -> &'a str {
    r.headers()
        .get(name)
        .unwrap_or_else(|| panic!("no {name}: {:?}", r.headers()))
        .to_str()
        .unwrap()
}

/// A tenant with 3 requests per minute gets three answers, each telling
/// what is left, then a 429 that says when to come back; other tenants are
/// not touched.
#[tokio::test]
async fn a_tenant_over_its_requests_per_minute_gets_429_with_openais_headers() {
    let config = ConfigFile::new(
        "quotas:\n  tenants:\n    acme: {requestsPerMinute: 3, tokensPerMinute: 100000}\n",
    );
    let (b, _sim, _agent) = fleet(&["--config", config.arg()], &[]).await;
    for left in [2, 1, 0] {
        let r = send(&b, None, "acme", chat_body()).await;
        assert_eq!(r.status(), 200);
        assert_eq!(header(&r, "x-ratelimit-limit-requests"), "3");
        assert_eq!(
            header(&r, "x-ratelimit-remaining-requests"),
            left.to_string()
        );
        assert_eq!(header(&r, "x-ratelimit-limit-tokens"), "100000");
        assert!(header(&r, "x-ratelimit-reset-requests").ends_with('s'));
    }
    let r = send(&b, None, "acme", chat_body()).await;
    assert_eq!(header(&r, "x-flowgate-drop-reason"), "quota-exceeded");
    let retry: u64 = header(&r, "retry-after").parse().unwrap();
    assert!((1..=60).contains(&retry), "{retry}");
    assert_eq!(header(&r, "x-ratelimit-remaining-requests"), "0");
    let e = assert_openai_error(r, 429).await;
    assert_eq!(e["error"]["code"], "quota_exceeded");
    assert_eq!(e["error"]["type"], "rate_limit_error");
    // Another tenant has no quota: no headers, no limit.
    let r = send(&b, None, "other", chat_body()).await;
    assert_eq!(r.status(), 200);
    assert!(r.headers().get("x-ratelimit-limit-requests").is_none());
    assert_eq!(
        metric(
            &b,
            "flowgate_requests_total",
            &[("reason", "quota-exceeded")]
        )
        .await,
        1.0
    );
}

/// A key's own quota counts tokens as the answers report them: the
/// estimate is reserved, the actual usage settled; a request that was
/// never served gives its share back.
#[tokio::test]
async fn a_keys_token_quota_settles_to_what_the_answers_used() {
    let keys = ConfigFile::new(
        "keys:\n  - key: sk-small\n    tenant: acme\n    \
         quota: {tokensPerMinute: 1000, maxConcurrent: 1}\n",
    );
    let (b, _sim, _agent) = fleet(
        &["--api-keys-file", keys.arg()],
        &["--output-tokens", "5", "--ttft-ms", "300"],
    )
    .await;
    // Estimated 2 + 600 tokens, used 2 + 5: the window keeps 7.
    let mut body = chat_body();
    body["max_tokens"] = 600.into();
    let r = send(&b, Some("sk-small"), "x", body.clone()).await;
    assert_eq!(r.status(), 200);
    let remaining: u64 = header(&r, "x-ratelimit-remaining-tokens").parse().unwrap();
    assert!((390..400).contains(&remaining), "reserved 602: {remaining}");
    // Settled when the request gives its slot back.
    b.wait_in_flight(0, Duration::from_secs(5)).await;
    let r = send(&b, Some("sk-small"), "x", body.clone()).await;
    assert_eq!(
        r.status(),
        200,
        "the first answer's unused tokens came back"
    );
    let remaining: u64 = header(&r, "x-ratelimit-remaining-tokens").parse().unwrap();
    assert!(
        (385..395).contains(&remaining),
        "7 kept + 602 reserved: {remaining}"
    );
    // The client has its answer before the balancer gives the slot back:
    // wait for that, so that the one in flight below is `first`.
    b.wait_in_flight(0, Duration::from_secs(5)).await;
    // One in flight at a time: a second concurrent request waits its turn
    // at the client (429), not in the queue.
    let mut small = chat_body();
    small["max_tokens"] = 5.into();
    let first = {
        let (url, small) = (b.url("/v1/chat/completions"), small.clone());
        tokio::spawn(async move {
            client()
                .post(url)
                .bearer_auth("sk-small")
                .json(&small)
                .send()
                .await
                .unwrap()
                .status()
        })
    };
    b.wait_in_flight(1, Duration::from_secs(5)).await;
    let r = send(&b, Some("sk-small"), "x", small).await;
    let e = assert_openai_error(r, 429).await;
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("in flight"),
        "{e}"
    );
    assert_eq!(first.await.unwrap(), 200);
    b.wait_in_flight(0, Duration::from_secs(5)).await;
    // Over its token quota, 1,000 per minute: an answer that used 1,100
    // prompt tokens.
    let mut long = chat_for(Some("sim-model"), &"abcd".repeat(1100));
    long["max_tokens"] = 5.into();
    assert_eq!(send(&b, Some("sk-small"), "x", long).await.status(), 200);
    b.wait_in_flight(0, Duration::from_secs(5)).await;
    let r = send(&b, Some("sk-small"), "x", chat_body()).await;
    assert_eq!(r.status(), 429);
    assert_eq!(header(&r, "x-ratelimit-remaining-tokens"), "0");
}

/// Refused by flow control after its quota was reserved: nothing counts.
#[tokio::test]
async fn a_request_refused_after_its_reservation_is_given_back() {
    let config = ConfigFile::new("quotas:\n  defaultTenant: {requestsPerMinute: 2}\n");
    let (b, _sim, _agent) = fleet(&["--config", config.arg()], &[]).await;
    // A model nobody serves: 404 after the quota was reserved.
    for _ in 0..3 {
        let r = send(&b, None, "t", chat_for(Some("nobody"), "hi")).await;
        assert_eq!(r.status(), 404);
    }
    let r = send(&b, None, "t", chat_body()).await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-ratelimit-remaining-requests"), "1");
}

#[test]
fn bad_quota_settings_stop_the_balancer() {
    for (yaml, want) in [
        (
            "quotas:\n  tenants:\n    acme: {requestsPerMinute: 0}\n",
            "quotas.tenants.acme.requestsPerMinute",
        ),
        ("quotas:\n  defaultTenant: {tokens: all}\n", "tokens"),
        ("quotas:\n  redisUrl: http://x\n", "redis://"),
    ] {
        let config = ConfigFile::new(yaml);
        let out = std::process::Command::new(bin("balancer"))
            .args(["--config", config.arg()])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{yaml}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(want), "{yaml}: {stderr}");
    }
}

/// Two balancers given one Redis share a tenant's quota: what one admitted
/// counts at the other, within the minute.
#[tokio::test]
async fn two_balancers_share_a_quota_through_redis() {
    let redis = Redis::start().await;
    let config = ConfigFile::new(&format!(
        "quotas:\n  tenants:\n    acme: {{requestsPerMinute: 4, tokensPerMinute: 10000}}\n  redisUrl: {}\n",
        redis.url
    ));
    let (a, _sim_a, _agent_a) = fleet(&["--config", config.arg()], &[]).await;
    let (b, _sim_b, _agent_b) = fleet(&["--config", config.arg()], &[]).await;
    let mut served = 0;
    for i in 0..8 {
        let which = if i % 2 == 0 { &a } else { &b };
        let r = send(which, None, "acme", chat_body()).await;
        match r.status().as_u16() {
            200 => served += 1,
            429 => assert_eq!(header(&r, "x-flowgate-drop-reason"), "quota-exceeded"),
            s => panic!("status {s}"),
        }
    }
    assert_eq!(served, 4, "4 per minute across both balancers");
}

/// A Redis that goes away: `open` admits (and counts the failure),
/// `closed` refuses with 503.
#[tokio::test]
async fn an_unreachable_quota_store_fails_open_or_closed_as_configured() {
    let redis = Redis::start().await;
    let quota = "quotas:\n  tenants:\n    acme: {requestsPerMinute: 100}\n";
    let open = ConfigFile::new(&format!("{quota}  redisUrl: {}\n", redis.url));
    let closed = ConfigFile::new(&format!(
        "{quota}  redisUrl: {}\n  onRedisError: closed\n",
        redis.url
    ));
    let (bo, _s1, _a1) = fleet(&["--config", open.arg()], &[]).await;
    let (bc, _s2, _a2) = fleet(&["--config", closed.arg()], &[]).await;
    assert_eq!(send(&bo, None, "acme", chat_body()).await.status(), 200);
    assert_eq!(send(&bc, None, "acme", chat_body()).await.status(), 200);
    drop(redis);
    let r = send(&bo, None, "acme", chat_body()).await;
    assert_eq!(r.status(), 200);
    assert!(
        metric(
            &bo,
            "flowgate_quota_store_errors_total",
            &[("result", "admitted")]
        )
        .await
            >= 1.0
    );
    let r = send(&bc, None, "acme", chat_body()).await;
    assert_eq!(header(&r, "x-flowgate-drop-reason"), "quota-unavailable");
    assert_openai_error(r, 503).await;
    // A balancer cannot start on a Redis it cannot reach.
    let out = std::process::Command::new(bin("balancer"))
        .args(["--config", open.arg()])
        .output()
        .unwrap();
    assert_ne!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stderr).contains("quota Redis"));
}

/// An async request delivered while its tenant is over its quota ends with
/// that 429 (retrying at once would meet the same window), and does not
/// hold back other tenants' async work.
#[tokio::test]
async fn an_async_request_over_its_tenants_quota_ends_with_the_429() {
    let dir = TempDir::new("quota-async");
    let config = ConfigFile::new("quotas:\n  tenants:\n    acme: {requestsPerMinute: 1}\n");
    let (b, _sim, _agent) = fleet(&["--config", config.arg(), "--async-dir", dir.arg()], &[]).await;
    let submit = |tenant: &'static str| {
        let url = b.url("/v1/async/chat/completions");
        async move {
            let r = client()
                .post(url)
                .header("x-gateway-inference-fairness-id", tenant)
                .json(&chat_body())
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 202);
            r.json::<Value>().await.unwrap()["id"]
                .as_str()
                .unwrap()
                .to_string()
        }
    };
    let ids = [
        submit("acme").await,
        submit("acme").await,
        submit("other").await,
    ];
    let views = wait_for(
        "the async requests to end",
        Duration::from_secs(20),
        || async {
            let mut views = Vec::new();
            for id in &ids {
                let v = get_json(&b.url(&format!("/v1/async/requests/{id}?wait=0"))).await;
                if v["status"] == "queued" || v["status"] == "dispatched" {
                    return None;
                }
                views.push(v);
            }
            Some(views)
        },
    )
    .await;
    let status = |v: &Value| v["response_status"].as_u64().unwrap();
    // The two of acme are delivered at once: either may be the one over.
    let mut acme = [status(&views[0]), status(&views[1])];
    acme.sort_unstable();
    assert_eq!((acme, status(&views[2])), ([200, 429], 200), "{views:?}");
    let over = views.iter().find(|v| status(v) == 429).unwrap();
    assert_eq!(
        over["response"]["error"]["code"], "quota_exceeded",
        "{over}"
    );
    assert_eq!(over["attempts"], 1, "ended, not retried: {over}");
}
