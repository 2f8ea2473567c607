//! Harness for black-box tests: spawns the real `balancer`, `agent` and
//! `llm-sim` binaries on 127.0.0.1 with ports picked here, waits on
//! conditions with deadlines, and kills every process when dropped.
#![allow(dead_code)]

use std::future::Future;
use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

mod redis;
#[allow(unused_imports)] // Not every test binary uses Redis.
pub use redis::Redis;

/// Path of a workspace binary, next to the test executable's directory.
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target/<profile>/deps");
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is missing: run `cargo build --workspace --bins` first (scripts/test does)",
        path.display()
    );
    path
}

/// A free TCP port on 127.0.0.1 (bound and released), never one this test
/// process handed out before: the OS may give a just-released port again,
/// and a balancer asked to listen twice on one port refuses to start.
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("free port");
        let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
}

/// A child process killed (SIGKILL) and reaped on drop.
pub struct Proc {
    pub child: Child,
    pub name: &'static str,
}

impl Proc {
    pub fn spawn(name: &'static str, args: &[String]) -> Proc {
        let child = Command::new(bin(name))
            .args(args)
            .env(
                "RUST_LOG",
                std::env::var("FLOWGATE_TEST_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {name}: {e}"));
        Proc { child, name }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([format!("-{sig}"), self.pid().to_string()])
            .status()
            .expect("run kill")
            .success();
        assert!(ok, "kill -{sig} {} failed", self.pid());
    }

    /// Waits for the process to exit on its own.
    pub fn wait_exit(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        None
    }

    /// Resident set size in KiB (Linux).
    pub fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid()))
            .expect("read /proc status");
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmRSS")
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Polls `cond` until it returns `Some`, or panics with `what` after `within`.
pub async fn wait_for<T, F, Fut>(what: &str, within: Duration, mut cond: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + within;
    loop {
        if let Some(v) = cond().await {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {within:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// GETs `url` and parses the JSON answer.
pub async fn get_json(url: &str) -> Value {
    let resp = client()
        .get(url)
        .send()
        .await
        .expect("GET reaches the server");
    resp.json().await.expect("JSON answer")
}

/// POSTs `body` as JSON to `url` and parses the JSON answer.
pub async fn post_json(url: &str, body: &Value) -> Value {
    let resp = client()
        .post(url)
        .json(body)
        .send()
        .await
        .expect("POST reaches the server");
    resp.json().await.expect("JSON answer")
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap()
}

pub struct Sim {
    pub proc: Proc,
    pub addr: SocketAddr,
}

impl Sim {
    pub fn start(args: &[&str]) -> Sim {
        Sim::start_at("127.0.0.1:0", args)
    }

    /// A simulator listening on `listen` (a server restarted where it was).
    pub fn start_at(listen: &str, args: &[&str]) -> Sim {
        let mut all: Vec<String> = vec!["--listen".into(), listen.into()];
        all.extend(args.iter().map(|s| s.to_string()));
        let mut proc = Proc::spawn("llm-sim", &all);
        let stdout = proc.child.stdout.take().expect("piped stdout");
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("read llm-sim banner");
        let addr = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("unexpected llm-sim banner {line:?}"))
            .parse()
            .expect("llm-sim address");
        Sim { proc, addr }
    }

    /// `n` simulated servers in one process (`llm-sim --servers n`), each
    /// reached at its own address; the first one is `self`.
    pub fn start_fleet(n: usize, args: &[&str]) -> (Sim, Vec<SocketAddr>) {
        let mut all: Vec<String> = vec![
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--servers".into(),
            n.to_string(),
        ];
        all.extend(args.iter().map(|s| s.to_string()));
        let mut proc = Proc::spawn("llm-sim", &all);
        let stdout = proc.child.stdout.take().expect("piped stdout");
        let addrs: Vec<SocketAddr> = BufReader::new(stdout)
            .lines()
            .take(n)
            .map(|line| {
                let line = line.expect("read llm-sim banner");
                line.trim()
                    .strip_prefix("listening on ")
                    .unwrap_or_else(|| panic!("unexpected llm-sim banner {line:?}"))
                    .parse()
                    .expect("llm-sim address")
            })
            .collect();
        assert_eq!(addrs.len(), n, "llm-sim announced every server");
        (
            Sim {
                proc,
                addr: addrs[0],
            },
            addrs,
        )
    }

    /// Waits until the simulator is generating nothing.
    pub async fn wait_idle(&self, within: Duration) {
        wait_for("the backend to be idle", within, || async {
            (self.stats().await["processing"] == 0).then_some(())
        })
        .await;
    }

    pub async fn stats(&self) -> Value {
        get_json(&format!("http://{}/sim/stats", self.addr)).await
    }
}

pub struct Balancer {
    pub proc: Proc,
    pub inference: SocketAddr,
    pub management: SocketAddr,
}

impl Balancer {
    pub async fn start(args: &[&str]) -> Balancer {
        let inference: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let management: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        Balancer::start_on(inference, management, args).await
    }

    /// A balancer on the ports given (one restarted where it was).
    pub async fn start_on(
        inference: SocketAddr,
        management: SocketAddr,
        args: &[&str],
    ) -> Balancer {
        let mut all: Vec<String> = vec![
            "--inference-addr".into(),
            inference.to_string(),
            "--management-addr".into(),
            management.to_string(),
            "--threads".into(),
            "2".into(),
            "--shutdown-grace-period".into(),
            "5".into(),
        ];
        all.extend(args.iter().map(|s| s.to_string()));
        let b = Balancer {
            proc: Proc::spawn("balancer", &all),
            inference,
            management,
        };
        let c = client();
        // A TLS inference port is the test's to check (this client speaks
        // plain HTTP only).
        let tls = args.contains(&"--tls-cert");
        wait_for("balancer to listen", Duration::from_secs(10), || {
            let c = c.clone();
            let urls = if tls {
                vec![b.mgmt("/health")]
            } else {
                vec![b.url("/health"), b.mgmt("/health")]
            };
            async move {
                for u in urls {
                    c.get(u)
                        .send()
                        .await
                        .ok()?
                        .status()
                        .is_success()
                        .then_some(())?;
                }
                Some(())
            }
        })
        .await;
        b
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.inference)
    }

    pub fn mgmt(&self, path: &str) -> String {
        format!("http://{}{path}", self.management)
    }

    pub async fn agents(&self) -> Value {
        get_json(&self.mgmt("/api/v1/agents")).await
    }

    pub async fn buffered(&self) -> u64 {
        self.agents().await["buffered_requests"].as_u64().unwrap()
    }

    pub async fn in_flight(&self) -> u64 {
        self.agents().await["in_flight_requests"].as_u64().unwrap()
    }

    /// Waits until `n` eligible endpoints are registered.
    pub async fn wait_eligible(&self, n: usize) {
        wait_for(
            &format!("{n} eligible endpoints"),
            Duration::from_secs(10),
            || async {
                let a = self.agents().await;
                let count = a["endpoints"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .filter(|e| e["eligible"] == true)
                    .count();
                (count == n).then_some(())
            },
        )
        .await;
    }

    pub async fn wait_buffered(&self, n: u64) {
        wait_for(
            &format!("{n} buffered requests"),
            Duration::from_secs(10),
            || async { (self.buffered().await == n).then_some(()) },
        )
        .await;
    }

    pub async fn wait_in_flight(&self, n: u64, within: Duration) {
        wait_for(&format!("{n} in-flight requests"), within, || async {
            (self.in_flight().await == n).then_some(())
        })
        .await;
    }
}

/// Starts an agent watching the model server at `backend_addr`, reporting
/// to `balancer` every 100 ms, with `extra_args` appended.
pub fn agent_at(backend_addr: &str, balancer: &Balancer, extra_args: &[&str]) -> Proc {
    let mut args: Vec<String> = vec![
        "--backend-addr".into(),
        backend_addr.into(),
        "--management-addr".into(),
        balancer.management.to_string(),
        "--monitoring-interval".into(),
        "100ms".into(),
    ];
    args.extend(extra_args.iter().map(|a| a.to_string()));
    Proc::spawn("agent", &args)
}

/// An agent per model server at `backends` reporting to both balancers
/// (`extra_args` appended), once both see every server eligible.
pub async fn agents_for_both(
    backends: impl IntoIterator<Item = impl ToString>,
    a: &Balancer,
    b: &Balancer,
    extra_args: &[&str],
) -> Vec<Proc> {
    let both = format!("{},{}", a.management, b.management);
    let mut args = vec!["--management-addr", both.as_str()];
    args.extend_from_slice(extra_args);
    let agents: Vec<Proc> = backends
        .into_iter()
        .map(|addr| agent_at(&addr.to_string(), a, &args))
        .collect();
    a.wait_eligible(agents.len()).await;
    b.wait_eligible(agents.len()).await;
    agents
}

/// Starts an agent watching `sim` and reporting to `balancer`.
pub fn agent(sim: &Sim, balancer: &Balancer) -> Proc {
    agent_at(&sim.addr.to_string(), balancer, &[])
}

/// A balancer and one simulator with an agent (100 ms interval), ready.
pub async fn fleet(balancer_args: &[&str], sim_args: &[&str]) -> (Balancer, Sim, Proc) {
    let b = Balancer::start(balancer_args).await;
    let sim = Sim::start(sim_args);
    let a = agent(&sim, &b);
    b.wait_eligible(1).await;
    (b, sim, a)
}

/// Uploads `lines` (JSONL) as a Batch API input file, with `key` as the
/// bearer key when given; asserts a 200 and returns the file object.
pub async fn upload_batch_file(b: &Balancer, key: Option<&str>, lines: &str) -> Value {
    let body = format!(
        "--XyZ\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n\
         --XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n\r\n\
         {lines}\r\n--XyZ--\r\n"
    );
    let mut req = client()
        .post(b.url("/v1/files"))
        .header("content-type", "multipart/form-data; boundary=XyZ")
        .body(body);
    if let Some(key) = key {
        req = req.header("authorization", format!("Bearer {key}"));
    }
    let resp = req.send().await.expect("the balancer answers");
    assert_eq!(resp.status(), 200, "upload");
    resp.json().await.expect("a file object")
}

/// Sends a chat completion in the background; resolves to its status.
pub fn spawn_chat(b: &Balancer, headers: &[(&str, &str)]) -> tokio::task::JoinHandle<u16> {
    let c = client();
    let url = b.url("/v1/chat/completions");
    let headers: Vec<(String, String)> = headers
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    tokio::spawn(async move {
        let mut req = c.post(url).json(&chat_body());
        for (k, v) in headers {
            req = req.header(k, v);
        }
        req.send()
            .await
            .expect("request reaches the balancer")
            .status()
            .as_u16()
    })
}

/// A chat completion for `model` (none: the field is left out).
pub fn chat_for(model: Option<&str>, content: &str) -> Value {
    let mut body = serde_json::json!({"messages": [{"role": "user", "content": content}]});
    if let Some(m) = model {
        body["model"] = serde_json::json!(m);
    }
    body
}

/// Turn `n` (from 0) of the conversation `tag` sent without a session
/// key, for `model`: a system prompt, each earlier turn's question and
/// answer, then its own question: what a chat client re-sends each turn.
pub fn conversation_turn(model: &str, tag: &str, n: usize) -> Value {
    let mut messages = vec![serde_json::json!({
        "role": "system",
        "content": "You answer questions about the fleet. ".repeat(10),
    })];
    for i in 0..=n {
        let question = format!("{tag}: question {i}");
        messages.push(serde_json::json!({"role": "user", "content": question}));
        if i < n {
            let answer = format!("{tag}: answer {i}");
            messages.push(serde_json::json!({"role": "assistant", "content": answer}));
        }
    }
    serde_json::json!({"model": model, "messages": messages})
}

pub fn chat_body() -> Value {
    serde_json::json!({"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]})
}

/// Sends a chat completion with optional simulator headers.
pub async fn chat(b: &Balancer, headers: &[(&str, &str)]) -> reqwest::Response {
    chat_with(&client(), b, headers, chat_body()).await
}

pub async fn chat_with(
    c: &reqwest::Client,
    b: &Balancer,
    headers: &[(&str, &str)],
    body: Value,
) -> reqwest::Response {
    let mut req = c.post(b.url("/v1/chat/completions")).json(&body);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    req.send().await.expect("request reaches the balancer")
}

/// Asserts an OpenAI-style error body and returns its parsed value.
pub async fn assert_openai_error(resp: reqwest::Response, status: u16) -> Value {
    assert_eq!(resp.status().as_u16(), status);
    let ct = resp.headers()["content-type"].to_str().unwrap().to_string();
    assert!(ct.starts_with("application/json"), "content-type {ct}");
    let v: Value = resp.json().await.unwrap();
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{v}"
    );
    assert!(v["error"]["type"].is_string(), "{v}");
    assert!(v["error"]["code"].is_string(), "{v}");
    v
}

/// A YAML config file in the temp dir, removed when dropped.
pub struct ConfigFile(PathBuf);

impl ConfigFile {
    pub fn new(yaml: &str) -> ConfigFile {
        let path = std::env::temp_dir().join(format!(
            "flowgate-test-{}-{}.yaml",
            std::process::id(),
            free_port()
        ));
        std::fs::write(&path, yaml).unwrap();
        ConfigFile(path)
    }

    pub fn arg(&self) -> &str {
        self.0.to_str().unwrap()
    }
}

impl Drop for ConfigFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The balancer's Prometheus exposition.
pub async fn metrics_text(b: &Balancer) -> String {
    client()
        .get(b.mgmt("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// The sum of the samples of a balancer metric whose labels match.
pub async fn metric(b: &Balancer, name: &str, labels: &[(&str, &str)]) -> f64 {
    let text = metrics_text(b).await;
    let lines = text.lines().map(|l| Ok(l.to_string()));
    let scrape = prometheus_parse::Scrape::parse(lines).unwrap();
    scrape
        .samples
        .iter()
        .filter(|s| s.metric == name)
        .filter(|s| labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
        .map(|s| match s.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => v,
            _ => 0.0,
        })
        .sum()
}

/// A fresh directory of the test's own, removed when dropped.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(name: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!("flowgate-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create a temporary directory");
        TempDir(dir)
    }

    /// The directory, as a command-line argument.
    pub fn arg(&self) -> &str {
        self.0.to_str().expect("a UTF-8 temporary path")
    }

    /// A file in the directory, as a command-line argument.
    pub fn path(&self, file: &str) -> String {
        self.0
            .join(file)
            .to_str()
            .expect("a UTF-8 temporary path")
            .to_string()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A Prometheus server of the test's own, killed and its data removed on
/// drop.
pub struct Prometheus {
    child: Child,
    _dir: TempDir,
}

impl Prometheus {
    /// Prometheus on 127.0.0.1:`port`, scraping `scrape`'s `/metrics`
    /// every 500 ms.
    pub fn start(port: u16, scrape: &str) -> Prometheus {
        let dir = TempDir::new(&format!("prom-{port}"));
        let config = dir.0.join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 500ms\n  evaluation_interval: 500ms\n\
                 scrape_configs:\n  - job_name: flowgate\n    metrics_path: /metrics\n\
                 \x20   static_configs:\n      - targets: ['{scrape}']\n"
            ),
        )
        .unwrap();
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!("--storage.tsdb.path={}", dir.path("data")))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect(
                "the prometheus command (Debian's prometheus package; scripts/test installs it)",
            );
        Prometheus { child, _dir: dir }
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Reads until the server closes the connection (or 10 s pass).
pub async fn read_to_close(s: &mut tokio::net::TcpStream) -> String {
    let mut out = Vec::new();
    let _ = tokio::time::timeout(
        Duration::from_secs(10),
        tokio::io::AsyncReadExt::read_to_end(s, &mut out),
    )
    .await;
    String::from_utf8_lossy(&out).into_owned()
}

/// Reads one response whose head says `content-length` (enough for the
/// balancer's own answers).
pub async fn read_response(s: &mut tokio::net::TcpStream) -> String {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = String::from_utf8_lossy(&out).into_owned();
        if let Some(end) = text.find("\r\n\r\n") {
            let length = text[..end]
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length:")
                        .map(|v| v.trim().parse::<usize>().unwrap())
                })
                .unwrap_or(0);
            if out.len() >= end + 4 + length {
                return text;
            }
        }
        let n =
            tokio::time::timeout_at(deadline.into(), tokio::io::AsyncReadExt::read(s, &mut buf))
                .await
                .expect("a response within 10 s")
                .expect("read");
        assert!(n > 0, "connection closed after {text:?}");
        out.extend_from_slice(&buf[..n]);
    }
}

/// The entry of `sim`'s endpoint in the balancer's `/api/v1/agents` answer.
pub fn endpoint_of<'a>(agents: &'a Value, sim: &Sim) -> &'a Value {
    agents["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["addr"] == sim.addr.to_string())
        .unwrap_or_else(|| panic!("{} not in {agents}", sim.addr))
}

/// Six turns of conversation `conv` (session `key-{conv}`, tagged
/// `conv{conv}`, prompts that share nothing), turn `t` sent to `url(t)`:
/// every turn is answered 200 and all six land on one of `sims`.
pub async fn six_turns_stay_on_one_server(
    sims: &[Sim],
    conv: usize,
    url: impl Fn(usize) -> String,
) {
    let c = client();
    let tag = format!("conv{conv}");
    for turn in 0..6 {
        let body = chat_for(Some("sim-model"), &format!("{tag} turn {turn} ").repeat(30));
        let r = c
            .post(url(turn))
            .header("x-session-id", format!("key-{conv}"))
            .header("x-sim-tag", &tag)
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        r.bytes().await.unwrap();
    }
    let counts = tagged_per_server(sims, &tag).await;
    assert!(
        counts.contains(&6),
        "{tag} was split over the servers: {counts:?}"
    );
}

/// How many requests tagged `tag` (`x-sim-tag`) each server received.
pub async fn tagged_per_server(sims: &[Sim], tag: &str) -> Vec<usize> {
    let mut counts = Vec::new();
    for s in sims {
        let arrivals = s.stats().await["arrivals"].as_array().unwrap().clone();
        counts.push(arrivals.iter().filter(|t| *t == tag).count());
    }
    counts
}
