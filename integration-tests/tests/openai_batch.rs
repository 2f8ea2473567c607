//! The official `openai` Python client (from PyPI, installed by
//! `scripts/test`) runs the Batch API example against the balancer: upload a
//! JSONL file, create a batch, wait for it, read the output file; plus a
//! batch that fails validation, a 409 cancel and a 404 (see
//! `integration-tests/scripts/openai_batch.py`).

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use common::*;

#[tokio::test]
async fn the_openai_python_clients_batch_example_works() {
    let dir = TempDir::new("batch");
    let (b, _sim, _agent) = fleet(&["--async-dir", dir.arg()], &[]).await;
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/openai_batch.py");
    let base = b.url("/v1");
    let out = tokio::task::spawn_blocking(move || {
        Command::new("python3")
            .arg(script)
            .args([base.as_str(), "sim-model"])
            .output()
            .expect("python3")
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "the openai client's batch example failed (is `openai` installed? scripts/test \
         installs it):\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("the script's JSON");
    assert_eq!(report["results"], 5);
    // Five answers from the model server, each delivered once.
    wait_for("5 answers counted", Duration::from_secs(5), || async {
        (metric(&b, "flowgate_requests_total", &[("code", "200")]).await == 5.0).then_some(())
    })
    .await;
}
