//! Tokens, not requests: every request gets a token estimate at admission,
//! and the estimate's bytes-per-token ratio is learned per model from the
//! `usage` the engines report.

mod common;

use std::time::Duration;

use common::*;

/// An engine whose tokenizer packs 2 bytes per token (the balancer starts
/// from 4): after a few answers the balancer's ratio for its model is 2.
#[tokio::test]
async fn the_prompt_ratio_is_learned_from_the_engines_usage() {
    let (b, _sim, _agent) = fleet(&[], &["--bytes-per-token", "2", "--output-tokens", "1"]).await;
    let ratio = || async {
        metric(
            &b,
            "flowgate_model_prompt_bytes_per_token",
            &[("model", "sim-model")],
        )
        .await
    };
    let prompt = "tokens ".repeat(600);
    for _ in 0..5 {
        let r = chat_with(&client(), &b, &[], chat_for(Some("sim-model"), &prompt)).await;
        assert_eq!(r.status(), 200);
    }
    wait_for("the learned ratio", Duration::from_secs(5), || async {
        let r = ratio().await;
        ((r - 2.0).abs() < 0.01).then_some(())
    })
    .await;
    // A model no agent reports is never learned (no series a client adds).
    let r = chat_with(&client(), &b, &[], chat_for(Some("nobody-serves-me"), "hi")).await;
    assert_eq!(r.status(), 404);
    let text = metrics_text(&b).await;
    assert!(!text.contains("nobody-serves-me"), "{text}");
}

#[test]
fn a_default_output_bound_out_of_range_is_refused_at_start() {
    for bad in ["0", "10000001", "-1"] {
        let out = std::process::Command::new(bin("balancer"))
            .arg(format!("--default-output-tokens={bad}"))
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{bad}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("default-output-tokens") || stderr.contains("default_output_tokens"),
            "{stderr}"
        );
    }
}
