//! The dashboard in a real browser: headless Chromium (Debian's `chromium`,
//! driven through `chromedriver` over the W3C WebDriver protocol) loads the
//! management port's `/` against a running balancer with a simulated fleet,
//! and the page must show the agents' numbers, follow their changes and
//! chart the traffic. A screenshot is kept at
//! `target/dashboard-screenshot.png` (or `$CARGO_TARGET_DIR/`).

mod common;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use base64::Engine as _;
use common::*;
use serde_json::{json, Value};

/// `chromedriver` on a port of its own, in its own process group so that
/// the browsers it starts die with it even when a test fails half-way.
struct ChromeDriver {
    child: Child,
    url: String,
}

impl ChromeDriver {
    async fn start() -> ChromeDriver {
        use std::os::unix::process::CommandExt;
        let port = free_port();
        let child = Command::new("chromedriver")
            .arg(format!("--port={port}"))
            .arg("--allowed-ips=127.0.0.1")
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot start chromedriver ({e}): install Debian's chromium and \
                     chromium-driver packages (scripts/test does)"
                )
            });
        let url = format!("http://127.0.0.1:{port}");
        let status = format!("{url}/status");
        wait_for("chromedriver to be ready", Duration::from_secs(20), || {
            let status = status.clone();
            async move {
                let resp = client().get(&status).send().await.ok()?;
                let v: Value = resp.json().await.ok()?;
                (v["value"]["ready"] == true).then_some(())
            }
        })
        .await;
        ChromeDriver { child, url }
    }

    async fn session(&self) -> Browser {
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": "/usr/bin/chromium",
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                         "--disable-dev-shm-usage", "--window-size=1280,900"],
            },
        }}});
        let resp: Value = client()
            .post(format!("{}/session", self.url))
            .json(&caps)
            .send()
            .await
            .expect("chromedriver answers")
            .json()
            .await
            .expect("JSON from chromedriver");
        let id = resp["value"]["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no browser session: {resp}"));
        Browser {
            base: format!("{}/session/{id}", self.url),
        }
    }
}

impl Drop for ChromeDriver {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-s", "KILL", "--", &format!("-{}", self.child.id())])
            .status();
        let _ = self.child.wait();
    }
}

/// One browser session.
struct Browser {
    base: String,
}

impl Browser {
    /// A WebDriver command; `body` is sent with POST only.
    async fn command(&self, method: reqwest::Method, path: &str, body: Value) -> Value {
        let mut req = client().request(method.clone(), format!("{}{path}", self.base));
        if method == reqwest::Method::POST {
            req = req.json(&body);
        }
        let resp: Value = req
            .send()
            .await
            .expect("chromedriver answers")
            .json()
            .await
            .expect("JSON from chromedriver");
        assert!(
            resp["value"].get("error").is_none(),
            "WebDriver {path}: {resp}"
        );
        resp["value"].clone()
    }

    async fn goto(&self, url: &str) {
        self.command(reqwest::Method::POST, "/url", json!({ "url": url }))
            .await;
    }

    /// The text of the first element matching `selector` (`null` if none).
    async fn text(&self, selector: &str) -> Value {
        self.command(
            reqwest::Method::POST,
            "/execute/sync",
            json!({
                "script": "const e = document.querySelector(arguments[0]); \
                           return e ? e.textContent : null;",
                "args": [selector],
            }),
        )
        .await
    }

    async fn count(&self, selector: &str) -> u64 {
        self.command(
            reqwest::Method::POST,
            "/execute/sync",
            json!({
                "script": "return document.querySelectorAll(arguments[0]).length;",
                "args": [selector],
            }),
        )
        .await
        .as_u64()
        .expect("a count")
    }

    /// Waits until `selector`'s text is `want`.
    async fn wait_text(&self, selector: &str, want: &str) {
        let mut last = Value::Null;
        let found = tokio::time::timeout(Duration::from_secs(20), async {
            loop {
                last = self.text(selector).await;
                if last == want {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
        .await;
        assert!(
            found.is_ok(),
            "{selector}: want {want:?}, page shows {last}"
        );
    }

    async fn screenshot(&self, path: &PathBuf) {
        let png = self
            .command(reqwest::Method::GET, "/screenshot", Value::Null)
            .await;
        let png = base64::engine::general_purpose::STANDARD
            .decode(png.as_str().expect("base64 screenshot"))
            .expect("valid base64");
        assert!(png.starts_with(b"\x89PNG"), "a PNG screenshot");
        std::fs::write(path, png).expect("write the screenshot");
    }

    async fn close(&self) {
        self.command(reqwest::Method::DELETE, "", Value::Null).await;
    }
}

/// A report for a simulated agent whose numbers the test chooses.
async fn report(b: &Balancer, slots_busy: u32, waiting: u32, kv: f64) {
    let body = json!({
        "protocol_version": 1, "agent_id": "dash-fake", "name": "dash-named",
        "backend": "vllm", "external_addr": "127.0.0.1:9", "models": ["dash-only"],
        "health": "ready", "slots_total": 8, "slots_busy": slots_busy,
        "requests_waiting": waiting, "kv_cache_usage": kv,
        "monitoring_interval_ms": 60_000,
    });
    let v = post_json(&b.mgmt("/api/v1/agents/dash-fake/report"), &body).await;
    assert!(v["status"].is_string(), "report accepted: {v}");
}

fn row(agent: &str, field: &str) -> String {
    format!("tr[data-agent=\"{agent}\"] td[data-field=\"{field}\"]")
}

#[tokio::test]
async fn the_dashboard_shows_agents_and_traffic_live_in_a_real_browser() {
    let (b, sim, _agent) = fleet(
        &[],
        &[
            "--ttft-ms",
            "20",
            "--tpot-ms",
            "2",
            "--prefix-cache-tokens",
            "100000",
        ],
    )
    .await;
    report(&b, 3, 2, 0.42).await;
    b.wait_eligible(2).await;
    assert_eq!(
        metric(
            &b,
            "flowgate_endpoint_kv_cache_usage_ratio",
            &[("agent", "dash-fake")]
        )
        .await,
        0.42
    );

    // Traffic for the charts: five plain answers and two streams.
    for _ in 0..5 {
        assert_eq!(chat(&b, &[]).await.status(), 200);
    }
    let c = client();
    for _ in 0..2 {
        let body = json!({"model": "sim-model", "stream": true,
                          "messages": [{"role": "user", "content": "hi"}]});
        let resp = chat_with(&c, &b, &[], body).await;
        assert_eq!(resp.status(), 200);
        resp.bytes().await.expect("the whole stream");
    }
    // Two with a latency objective each can meet (a minute to the first
    // token).
    for _ in 0..2 {
        let r = chat(&b, &[("x-slo-ttft-ms", "60000")]).await;
        assert_eq!(r.status(), 200);
    }
    // A long prompt twice: the engine finds it cached the second time.
    let long = "a prompt the engine caches ".repeat(40);
    for _ in 0..2 {
        let r = chat_with(&c, &b, &[], chat_for(Some("sim-model"), &long)).await;
        assert_eq!(r.status(), 200);
        r.bytes().await.unwrap();
    }
    let sim_endpoint = wait_for("the answers settled", Duration::from_secs(5), || async {
        let e = endpoint_of(&b.agents().await, &sim).clone();
        (e["cache"]["predicted_hits"] == 1).then_some(e)
    })
    .await;
    let cache = &sim_endpoint["cache"];
    let hits = cache["cached_tokens"].as_f64().unwrap() / cache["prompt_tokens"].as_f64().unwrap();
    let sim_agent = sim_endpoint["agent"]["agent_id"]
        .as_str()
        .unwrap()
        .to_string();

    let driver = ChromeDriver::start().await;
    let browser = driver.session().await;
    browser.goto(&b.mgmt("/")).await;

    // The simulated agent's numbers, as reported.
    browser.wait_text(&row("dash-fake", "slots"), "3 / 8").await;
    // The operator's name for the agent, its id on hover.
    browser
        .wait_text(&row("dash-fake", "agent"), "dash-named")
        .await;
    browser.wait_text(&row("dash-fake", "kv"), "42 %").await;
    browser.wait_text(&row("dash-fake", "queue"), "2").await;
    browser
        .wait_text(&row("dash-fake", "backend"), "vllm")
        .await;
    browser
        .wait_text(&row("dash-fake", "models"), "dash-only")
        .await;
    // The llm-sim agent's row and the summary.
    assert_eq!(
        browser.count("#agents tbody tr").await,
        2,
        "one row per agent"
    );
    browser.wait_text("#tile-agents", "2 / 2").await;
    // What the engine said it reused, per endpoint.
    let percent = format!("{} %", (hits * 100.0).round());
    browser
        .wait_text(&row(&sim_agent, "cache_hits"), &percent)
        .await;
    browser
        .wait_text(&row("dash-fake", "cache_hits"), "–")
        .await;

    // The page follows new reports without a reload.
    report(&b, 7, 5, 0.93).await;
    browser.wait_text(&row("dash-fake", "slots"), "7 / 8").await;
    browser.wait_text(&row("dash-fake", "queue"), "5").await;
    browser.wait_text(&row("dash-fake", "kv"), "93 %").await;

    // Outcomes counted over the window, and the TTFT chart drawn.
    browser
        .wait_text("#legend-outcomes [data-outcome=\"200\"]", "200 (11)")
        .await;
    assert!(
        browser
            .count("#chart-ttft polyline, #chart-ttft circle")
            .await
            >= 1,
        "the TTFT chart has a line"
    );

    // Both requests with an objective met it.
    browser
        .wait_text("#legend-objectives", "met 2 of 2 (100 %)")
        .await;
    assert!(
        browser
            .count("#chart-objectives polyline, #chart-objectives circle")
            .await
            >= 1,
        "the objectives chart has a line"
    );

    // The tenants that spent the most: the eleven answers above, sent with
    // no fairness id.
    browser
        .wait_text(
            "tr[data-tenant=\"default\"] td[data-field=\"requests\"]",
            "11",
        )
        .await;

    // A tenant's request waits for the (now full) simulated agent's model:
    // its queue appears, with the tenant and the count.
    report(&b, 8, 5, 0.93).await;
    browser
        .wait_text(&row("dash-fake", "state"), "saturated: slots-full")
        .await;
    let waiting = {
        let b_url = b.url("/v1/chat/completions");
        tokio::spawn(async move {
            client()
                .post(b_url)
                .header("x-gateway-inference-fairness-id", "tenant-dash")
                .header("x-flowgate-request-ttl", "60s")
                .json(&chat_for(Some("dash-only"), "wait"))
                .send()
                .await
        })
    };
    browser
        .wait_text(
            "tr[data-flow=\"0/tenant-dash\"] td[data-field=\"requests\"]",
            "1",
        )
        .await;
    browser.wait_text("#tile-buffered", "1 / 30").await;

    let dir = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"));
    std::fs::create_dir_all(&dir).expect("create the target folder");
    let target = dir.join("dashboard-screenshot.png");
    browser.screenshot(&target).await;
    browser.close().await;
    waiting.abort();
}
