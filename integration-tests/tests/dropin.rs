//! Drop-in for clients with their own idea of model names: an agent's
//! `--model-alias` names route like the served model, `/v1/models` lists
//! them, and a name nobody serves gets a 404 that says what is served.

mod common;

use std::time::Duration;

use common::*;
use serde_json::Value;

#[tokio::test]
async fn model_aliases_route_and_unknown_names_are_told_what_is_served() {
    let b = Balancer::start(&[]).await;
    let sim = Sim::start(&["--model", "served-model"]);
    let _agent = agent_at(
        &sim.addr.to_string(),
        &b,
        &["--model-alias", "gpt-4o-mini", "--model-alias", "chat"],
    );
    b.wait_eligible(1).await;
    for name in ["served-model", "gpt-4o-mini", "chat"] {
        let r = chat_with(&client(), &b, &[], chat_for(Some(name), "hi")).await;
        assert_eq!(r.status(), 200, "{name}");
    }
    let models = get_json(&b.url("/v1/models")).await;
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m["id"].as_str())
        .collect();
    assert_eq!(ids, ["chat", "gpt-4o-mini", "served-model"]);
    let r = chat_with(&client(), &b, &[], chat_for(Some("gpt-5"), "hi")).await;
    let err: Value = assert_openai_error(r, 404).await;
    let message = err["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("gpt-5") && message.contains("served: chat, gpt-4o-mini, served-model"),
        "{message}"
    );
    b.wait_in_flight(0, Duration::from_secs(5)).await;
}

#[test]
fn the_agent_refuses_an_empty_or_huge_alias() {
    for bad in ["", &"x".repeat(257)] {
        let out = std::process::Command::new(bin("agent"))
            .args(["--backend-addr", "127.0.0.1:1", "--model-alias", bad])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{bad:?}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("model alias"));
    }
}

/// A batch may target the Responses API, as OpenAI's Batch API allows.
#[tokio::test]
async fn a_batch_may_target_the_responses_api() {
    let dir = TempDir::new("dropin-batch");
    let (b, _sim, _agent) = fleet(&["--async-dir", dir.arg()], &[]).await;
    let line = r#"{"custom_id":"r1","method":"POST","url":"/v1/responses","body":{"input":"hi"}}"#;
    let file = upload_batch_file(&b, None, line).await;
    let batch = post_json(
        &b.url("/v1/batches"),
        &serde_json::json!({"input_file_id": file["id"], "endpoint": "/v1/responses",
            "completion_window": "24h"}),
    )
    .await;
    assert_eq!(batch["status"], "in_progress", "{batch}");
    let id = batch["id"].as_str().unwrap().to_string();
    let done = wait_for("the batch to complete", Duration::from_secs(10), || async {
        let v = get_json(&b.url(&format!("/v1/batches/{id}"))).await;
        (v["status"] == "completed").then_some(v)
    })
    .await;
    assert_eq!(done["request_counts"]["completed"], 1, "{done}");
}
