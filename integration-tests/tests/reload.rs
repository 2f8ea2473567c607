//! Hot reload: SIGHUP reads the config file again and applies keys, model
//! rules and limits to new requests without dropping one; a bad file keeps
//! the running config.

mod common;

use std::time::{Duration, Instant};

use common::*;

fn hangup(b: &Balancer) {
    let status = std::process::Command::new("kill")
        .args(["-HUP", &b.proc.child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

async fn reloads(b: &Balancer, result: &str) -> f64 {
    metric(b, "flowgate_config_reloads_total", &[("result", result)]).await
}

/// Status of a chat for `model` with key `key`.
async fn status_with(b: &Balancer, key: &str, model: &str) -> u16 {
    client()
        .post(b.url("/v1/chat/completions"))
        .bearer_auth(key)
        .json(&chat_for(Some(model), "hi"))
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

#[tokio::test]
async fn sighup_reloads_keys_and_models_under_load_and_a_bad_file_keeps_the_old() {
    let dir = TempDir::new("reload");
    let keys = dir.path("keys.yaml");
    let config = dir.path("balancer.yaml");
    std::fs::write(&keys, "keys:\n  - {key: key-a, tenant: a}\n").unwrap();
    let write_config = |alias: &str| {
        std::fs::write(
            &config,
            format!(
                "apiKeysFile: {keys}\nmaxBufferedRequests: 100\nmodels:\n  aliases:\n    \
                 sim-model: [{alias}]\n"
            ),
        )
        .unwrap();
    };
    write_config("old-name");
    let (b, _sim, _agent) = fleet(
        &["--config", &config],
        &["--slots", "2", "--ttft-ms", "50", "--output-tokens", "2"],
    )
    .await;
    assert_eq!(status_with(&b, "key-a", "old-name").await, 200);
    assert_eq!(status_with(&b, "key-b", "sim-model").await, 401);

    // Eight clients keep both slots busy and six requests queued while
    // the config changes twice.
    let until = Instant::now() + Duration::from_secs(3);
    let load: Vec<_> = (0..8)
        .map(|_| {
            let (c, url) = (client(), b.url("/v1/chat/completions"));
            tokio::spawn(async move {
                let mut statuses = Vec::new();
                while Instant::now() < until {
                    let r = c
                        .post(&url)
                        .bearer_auth("key-a")
                        .json(&chat_for(Some("sim-model"), "load"))
                        .send()
                        .await;
                    statuses.push(r.map_or(0, |r| r.status().as_u16()));
                }
                statuses
            })
        })
        .collect();
    b.wait_in_flight(2, Duration::from_secs(5)).await;

    std::fs::write(
        &keys,
        "keys:\n  - {key: key-a, tenant: a}\n  - {key: key-b, tenant: b}\n",
    )
    .unwrap();
    write_config("new-name");
    hangup(&b);
    wait_for("the reload", Duration::from_secs(5), || async {
        (reloads(&b, "ok").await == 1.0).then_some(())
    })
    .await;
    assert_eq!(status_with(&b, "key-b", "new-name").await, 200);
    assert_eq!(
        status_with(&b, "key-a", "old-name").await,
        404,
        "the old alias is gone"
    );

    // A file that does not parse: counted, and the running config stays.
    std::fs::write(&config, "models:\n  aliases: [unclosed\n").unwrap();
    hangup(&b);
    wait_for("the failed reload", Duration::from_secs(5), || async {
        (reloads(&b, "error").await == 1.0).then_some(())
    })
    .await;
    assert_eq!(status_with(&b, "key-b", "new-name").await, 200);

    let mut served = 0;
    for client in load {
        let statuses = client.await.unwrap();
        assert!(statuses.iter().all(|&s| s == 200), "{statuses:?}");
        served += statuses.len();
    }
    assert!(served >= 16, "{served} requests under load");
    assert_eq!(reloads(&b, "ok").await, 1.0);
    b.wait_in_flight(0, Duration::from_secs(5)).await;
}
