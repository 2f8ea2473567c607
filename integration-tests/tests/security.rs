//! API keys and request ids, seen from a client.

mod common;

use std::time::Duration;

use common::*;
use sha2::{Digest, Sha256};

const AUTH: &str = "authorization";

fn bearer(key: &str) -> String {
    format!("Bearer {key}")
}

/// 401 without a key or with a wrong one (`/health` stays open); a key's
/// tenant and priority ceiling beat the flow-control headers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn api_keys_bind_requests_to_their_tenant_and_ceiling() {
    let digest: String = Sha256::digest(b"sk-acme")
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let keys = ConfigFile::new(&format!(
        "keys:\n  - sha256: {digest}\n    tenant: acme\n    maxPriority: 0\n  \
         - key: sk-ops\n    tenant: ops\n"
    ));
    let config = ConfigFile::new("objectives:\n  urgent: 10\n");
    let (b, _sim, _agent) = fleet(
        &["--api-keys-file", keys.arg(), "--config", config.arg()],
        &["--slots", "1"],
    )
    .await;
    let c = client();

    assert_eq!(c.get(b.url("/health")).send().await.unwrap().status(), 200);
    let resp = chat(&b, &[]).await;
    assert_eq!(resp.headers()["www-authenticate"], "Bearer");
    let err = assert_openai_error(resp, 401).await;
    assert_eq!(err["error"]["code"], "missing_api_key");
    let wrong = bearer("sk-acme-");
    let err = assert_openai_error(chat(&b, &[(AUTH, wrong.as_str())]).await, 401).await;
    assert_eq!(err["error"]["code"], "invalid_api_key");
    let models = c.get(b.url("/v1/models")).send().await.unwrap();
    assert_eq!(models.status(), 401);
    let ops = bearer("sk-ops");
    let models = c
        .get(b.url("/v1/models"))
        .header(AUTH, &ops)
        .send()
        .await
        .unwrap();
    assert_eq!(models.status(), 200);

    // The ops key fills the only slot; an acme request asking to be
    // "mallory" at priority 10 waits as acme at its ceiling, 0.
    let running = spawn_chat(&b, &[(AUTH, ops.as_str()), ("x-sim-ttft-ms", "1500")]);
    b.wait_in_flight(1, Duration::from_secs(5)).await;
    let acme = bearer("sk-acme");
    let waiting = spawn_chat(
        &b,
        &[
            (AUTH, acme.as_str()),
            ("x-gateway-inference-fairness-id", "mallory"),
            ("x-gateway-inference-objective", "urgent"),
        ],
    );
    b.wait_buffered(1).await;
    let queued = |tenant: &'static str, priority: &'static str| {
        let b = &b;
        async move {
            metric(
                b,
                "inference_extension_flow_control_queue_size",
                &[("fairness_id", tenant), ("priority", priority)],
            )
            .await
        }
    };
    assert_eq!(queued("acme", "0").await, 1.0);
    assert_eq!(queued("mallory", "10").await, 0.0);
    assert_eq!(running.await.unwrap(), 200);
    assert_eq!(waiting.await.unwrap(), 200);
}

/// `x-request-id` comes back as sent, or generated and unique; the
/// balancer's own answers carry it too.
#[tokio::test]
async fn request_ids_are_kept_or_generated() {
    let (b, _sim, _agent) = fleet(&[], &["--slots", "2"]).await;
    let id = |r: &reqwest::Response| r.headers()["x-request-id"].to_str().unwrap().to_string();
    let given = chat(&b, &[("x-request-id", "client-42")]).await;
    assert_eq!(given.status(), 200);
    assert_eq!(id(&given), "client-42");
    let first = id(&chat(&b, &[]).await);
    let second = id(&chat(&b, &[]).await);
    assert_ne!(first, second);
    assert!(
        first.len() >= 16 && first.bytes().all(|c| c.is_ascii_hexdigit()),
        "{first}"
    );
    // Unusable ids (spaces, too long) are replaced.
    let long = "x".repeat(200);
    for bad in ["has space", long.as_str()] {
        let r = chat(&b, &[("x-request-id", bad)]).await;
        assert_ne!(id(&r), bad);
    }
    let missing = client()
        .get(b.url("/nowhere"))
        .header("x-request-id", "lost-1")
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), 404);
    assert_eq!(id(&missing), "lost-1");
}

/// With a management token, reports and deregistrations need it (an agent
/// given the token registers; a bare request gets 401) and reads stay open.
#[tokio::test]
async fn the_management_token_guards_registration() {
    let b = Balancer::start(&["--management-token", "mgmt-s3cret"]).await;
    let c = client();
    let report = serde_json::json!({
        "protocol_version": 1, "agent_id": "intruder", "external_addr": "127.0.0.1:9",
        "models": ["m"], "health": "ready", "slots_total": 1, "slots_busy": 0,
        "requests_waiting": 0, "monitoring_interval_ms": 100, "draining": false
    });
    let url = b.mgmt("/api/v1/agents/intruder/report");
    for auth in [None, Some("Bearer wrong"), Some("Basic bWdtdC1zM2NyZXQ=")] {
        let mut req = c.post(&url).json(&report);
        if let Some(a) = auth {
            req = req.header(AUTH, a);
        }
        let resp = req.send().await.unwrap();
        assert_eq!(resp.headers()["www-authenticate"], "Bearer", "{auth:?}");
        assert_openai_error(resp, 401).await;
    }
    let resp = c
        .delete(b.mgmt("/api/v1/agents/intruder"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 401);
    assert_eq!(b.agents().await["endpoints"].as_array().unwrap().len(), 0);

    let sim = Sim::start(&["--slots", "2"]);
    let _agent = agent_at(
        &sim.addr.to_string(),
        &b,
        &["--management-token", "mgmt-s3cret"],
    );
    b.wait_eligible(1).await;
    assert_eq!(chat(&b, &[]).await.status(), 200);
    let metrics = c.get(b.mgmt("/metrics")).send().await.unwrap();
    assert_eq!(metrics.status(), 200);
}

/// Without a token, the balancer will not serve the management port beyond
/// loopback unless told to (it exits before binding anything).
#[test]
fn an_open_management_port_without_a_token_is_refused() {
    let out = std::process::Command::new(bin("balancer"))
        .args(["--management-addr", "0.0.0.0:9"])
        .env_remove("FLOWGATE_MANAGEMENT_TOKEN")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--allow-open-management"), "{stderr}");
}
