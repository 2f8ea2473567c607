//! TLS on the inference port: a self-signed certificate made by the
//! `openssl` command for 127.0.0.1, and `curl` as the client. A chat
//! completion goes through to a simulated model server over HTTPS; a client
//! that does not trust the certificate, or speaks plain HTTP, gets no answer;
//! bad certificate files stop the balancer with a clear error.

mod common;

use std::process::{Command, Output};

use common::*;

/// A self-signed P-256 certificate for 127.0.0.1, valid for a day.
fn self_signed(dir: &TempDir) -> (String, String) {
    let (cert, key) = (dir.path("cert.pem"), dir.path("key.pem"));
    let out = Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=flowgate-test",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            &key,
            "-out",
            &cert,
        ])
        .output()
        .expect("the openssl command (Debian's openssl package)");
    assert!(
        out.status.success(),
        "openssl: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    (cert, key)
}

fn curl(args: &[&str]) -> Output {
    Command::new("curl")
        .args(["--silent", "--show-error", "--max-time", "20"])
        .args(args)
        .output()
        .expect("the curl command")
}

#[tokio::test]
async fn chat_completions_are_served_over_tls() {
    let dir = TempDir::new("tls");
    let (cert, key) = self_signed(&dir);
    let (b, _sim, _agent) = fleet(&["--tls-cert", &cert, "--tls-key", &key], &[]).await;
    let url = format!("https://{}/v1/chat/completions", b.inference);
    let body = chat_body().to_string();

    let out = curl(&[
        "--cacert",
        &cert,
        "-H",
        "content-type: application/json",
        "--data",
        &body,
        "--write-out",
        "\n%{http_code} %{ssl_verify_result}",
        &url,
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "curl: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (json, status) = text.rsplit_once('\n').unwrap();
    assert_eq!(status, "200 0", "HTTP 200, certificate verified");
    let answer: serde_json::Value = serde_json::from_str(json).expect("a JSON answer");
    assert_eq!(answer["object"], "chat.completion", "{answer}");

    // Without trusting the certificate: the handshake fails, nothing served.
    let out = curl(&["--data", &body, &url]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("certificate"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Plain HTTP on the TLS port gets no HTTP answer.
    let out = curl(&[
        "--data",
        &body,
        &format!("http://{}/v1/chat/completions", b.inference),
    ]);
    assert!(!out.status.success(), "plain HTTP must not be served");
    assert_eq!(
        metric(&b, "flowgate_requests_total", &[("code", "200")]).await,
        1.0,
        "one request served"
    );
}

#[test]
fn bad_certificate_files_stop_the_balancer_with_a_clear_error() {
    let dir = TempDir::new("tls-bad");
    let (cert, key) = self_signed(&dir);
    let garbage = dir.path("garbage.pem");
    std::fs::write(&garbage, "not a key\n").unwrap();
    let run = |args: &[&str]| {
        let port = free_port().to_string();
        let mgmt = free_port().to_string();
        let out = Command::new(bin("balancer"))
            .args(["--inference-addr", &format!("127.0.0.1:{port}")])
            .args(["--management-addr", &format!("127.0.0.1:{mgmt}")])
            .args(args)
            .output()
            .expect("run the balancer");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, err) = run(&["--tls-cert", "/nonexistent.pem", "--tls-key", &key]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("cannot read /nonexistent.pem"), "{err}");
    let (code, err) = run(&["--tls-cert", &cert, "--tls-key", &garbage]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("PEM private key"), "{err}");
    // A key that is not the certificate's.
    let other = TempDir::new("tls-other");
    let (_, other_key) = self_signed(&other);
    let (code, err) = run(&["--tls-cert", &cert, "--tls-key", &other_key]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("do not work together"), "{err}");
    let (code, err) = run(&["--tls-cert", &cert]);
    assert_eq!(code, Some(2), "a usage error: {err}");
    assert!(err.contains("--tls-key"), "{err}");
}
