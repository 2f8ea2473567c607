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
