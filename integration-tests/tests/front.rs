//! Two balancers behind a real front load balancer, as operators deploy
//! them: Debian's HAProxy and nginx with the repository's own configs
//! (`deploy/haproxy.cfg`: readiness checks; both: a refused connection
//! retried on the other balancer). Under closed-loop load: `kill -9` of
//! one balancer fails only requests
//! in flight on it, every later one is served by the other, and its slot
//! shares move to the survivor within two report intervals; a rolling
//! restart of both, one after the other, fails no request; a conversation
//! whose turns HAProxy spreads over both stays on one server.

mod common;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;

/// The front load balancers the repository ships a config for.
#[derive(Debug, Clone, Copy)]
enum Kind {
    /// Debian's haproxy with `deploy/haproxy.cfg`.
    Haproxy,
    /// Debian's nginx with `deploy/nginx.conf`.
    Nginx,
}

/// A real front load balancer (scripts/test installs Debian's haproxy and
/// nginx-light) running its config from `deploy/` in front of two
/// balancers, stopped when dropped.
struct Front {
    child: std::process::Child,
    addr: String,
    _dir: TempDir,
}

impl Front {
    /// Another test's process may take the port picked for it first: then
    /// the front exits and it tries another one.
    async fn start(kind: Kind, a: &Balancer, b: &Balancer) -> Front {
        let deploy = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy");
        let dir = TempDir::new("front");
        for _ in 0..5 {
            let addr = format!("127.0.0.1:{}", free_port());
            let vars = [
                ("FRONT_ADDR", addr.clone()),
                ("BALANCER_A", a.inference.to_string()),
                ("BALANCER_B", b.inference.to_string()),
            ];
            let mut command = match kind {
                Kind::Haproxy => {
                    let mut c = std::process::Command::new("haproxy");
                    c.args(["-db", "-f"]).arg(deploy.join("haproxy.cfg"));
                    c.envs(vars.iter().map(|(k, v)| (k, v)));
                    c
                }
                Kind::Nginx => {
                    // What envsubst does, and the file paths in the test's
                    // own directory.
                    let mut conf = std::fs::read_to_string(deploy.join("nginx.conf")).unwrap();
                    for (k, v) in &vars {
                        conf = conf.replace(&format!("${{{k}}}"), v);
                    }
                    let conf = conf.replace("/tmp/flowgate-nginx", &dir.path("nginx"));
                    std::fs::write(dir.path("nginx.conf"), conf).unwrap();
                    let mut c = std::process::Command::new("nginx");
                    c.args([
                        "-e",
                        "stderr",
                        "-p",
                        dir.arg(),
                        "-c",
                        &dir.path("nginx.conf"),
                    ]);
                    c
                }
            };
            let mut child = command
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap_or_else(|e| panic!("{kind:?} (scripts/test installs it): {e}"));
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline {
                if child.try_wait().ok().flatten().is_some() {
                    break;
                }
                let ready = client()
                    .get(format!("http://{addr}/health/ready"))
                    .send()
                    .await
                    .is_ok_and(|r| r.status() == 200);
                if ready {
                    return Front {
                        child,
                        addr,
                        _dir: dir,
                    };
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        panic!("{kind:?} did not start on any of 5 ports");
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
}

impl Drop for Front {
    fn drop(&mut self) {
        // SIGKILL leaves nginx's workers behind: SIGTERM first, for both.
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Two balancers (`args` each), four servers of `slots` slots whose agents
/// report to both, and a front load balancer of `kind`.
async fn two_behind(
    kind: Kind,
    slots: &str,
    args: &[&str],
) -> (Balancer, Balancer, Vec<Sim>, Vec<Proc>, Front) {
    let a = Balancer::start(args).await;
    let b = Balancer::start(args).await;
    let sims: Vec<Sim> = (0..4)
        .map(|_| Sim::start(&["--slots", slots, "--ttft-ms", "30"]))
        .collect();
    let agents = agents_for_both(sims.iter().map(|s| s.addr), &a, &b, &[]).await;
    let front = Front::start(kind, &a, &b).await;
    (a, b, sims, agents, front)
}

/// One request's end: its client, when it was sent, and its status (0: no
/// answer).
type Outcome = (usize, Instant, u16);

/// Closed-loop clients sending chats through a front until finished.
struct Load {
    stop: Arc<AtomicBool>,
    /// Each client's outcomes.
    clients: Vec<tokio::task::JoinHandle<Vec<Outcome>>>,
}

impl Load {
    /// `clients` clients, each sending its next chat through `front` when
    /// the last one ended.
    fn start(front: &Front, clients: usize) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let url = front.url("/v1/chat/completions");
        let clients = (0..clients)
            .map(|i| {
                let (url, stop) = (url.clone(), stop.clone());
                tokio::spawn(async move {
                    let c = client();
                    let mut outcomes = Vec::new();
                    while !stop.load(Ordering::Relaxed) {
                        let sent = Instant::now();
                        let n = outcomes.len();
                        let body = chat_for(Some("sim-model"), &format!("client {i} request {n}"));
                        let status = match c.post(&url).json(&body).send().await {
                            Ok(r) => {
                                let status = r.status().as_u16();
                                // A body cut short counts as a failure.
                                if r.bytes().await.is_ok() {
                                    status
                                } else {
                                    0
                                }
                            }
                            Err(_) => 0,
                        };
                        outcomes.push((i, sent, status));
                    }
                    outcomes
                })
            })
            .collect();
        Load { stop, clients }
    }

    /// Stops the clients once their requests out have ended: every
    /// request's outcome.
    async fn finish(self) -> Vec<Outcome> {
        self.stop.store(true, Ordering::Relaxed);
        let mut all = Vec::new();
        for c in self.clients {
            all.extend(c.await.unwrap());
        }
        all
    }
}

/// No server ran more than its slots: none queued a request.
async fn assert_never_overcommitted(sims: &[Sim]) {
    for s in sims {
        assert_eq!(
            s.stats().await["max_deferred"],
            0,
            "a server was over-committed"
        );
    }
}

/// The sum of the slot shares `b` was given, over all its endpoints.
async fn shares(b: &Balancer) -> u64 {
    b.agents().await["endpoints"]
        .as_array()
        .map(|eps| {
            eps.iter()
                .map(|e| e["agent"]["slot_share"].as_u64().unwrap_or(0))
                .sum()
        })
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill_9_of_one_balancer_behind_haproxy_fails_only_its_requests_in_flight() {
    kill_9_of_one_balancer(Kind::Haproxy).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill_9_of_one_balancer_behind_nginx_fails_only_its_requests_in_flight() {
    kill_9_of_one_balancer(Kind::Nginx).await;
}

async fn kill_9_of_one_balancer(kind: Kind) {
    let (a, b, sims, _agents, front) = two_behind(kind, "2", &[]).await;
    let load = Load::start(&front, 16);
    wait_for(
        "load on both balancers",
        Duration::from_secs(10),
        || async { (a.in_flight().await > 0 && b.in_flight().await > 0).then_some(()) },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    drop(a); // SIGKILL
    let killed = Instant::now();
    // The survivor gets the dead balancer's slots: all 8 within two report
    // intervals (100 ms each) of the agents' next reports.
    wait_for("the survivor's shares", Duration::from_secs(3), || async {
        (shares(&b).await == 8).then_some(())
    })
    .await;
    let moved = killed.elapsed();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let outcomes = load.finish().await;
    let failed: Vec<_> = outcomes.iter().filter(|(_, _, s)| *s != 200).collect();
    let late: Vec<_> = failed
        .iter()
        .filter(|(_, sent, _)| *sent > killed)
        .collect();
    assert!(
        late.is_empty(),
        "requests sent after the kill failed: {late:?}"
    );
    // Only what reached the killed balancer before it was gone (running or
    // queued there, or sent in the moment it took to die): a client has one
    // request out at a time, and a second one only in that moment.
    for client in 0..16 {
        let times = failed.iter().filter(|(i, _, _)| *i == client).count();
        assert!(
            times <= 2,
            "client {client} failed {times} times: {failed:?}"
        );
    }
    let after = outcomes
        .iter()
        .filter(|(_, sent, _)| *sent > killed)
        .count();
    assert!(after >= 16, "only {after} requests after the kill");
    // It takes at most 2 report intervals (the report its port refuses,
    // then the next one, which carries the survivor's new share): 100 to
    // 200 ms; 1.5 s leaves room for a loaded CI machine.
    eprintln!("the shares moved to the survivor in {moved:?}");
    assert!(
        moved < Duration::from_millis(1500),
        "shares moved after {moved:?}"
    );
    assert_never_overcommitted(&sims).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rolling_restart_behind_haproxy_fails_no_request() {
    // Longer than HAProxy's check interval (500 ms) x its fall count (1).
    let args = ["--drain-delay", "1500ms"];
    let (a, b, sims, _agents, front) = two_behind(Kind::Haproxy, "2", &args).await;
    let load = Load::start(&front, 8);
    let mut restarted = Vec::new();
    for mut old in [a, b] {
        old.proc.signal("TERM");
        let (inference, management) = (old.inference, old.management);
        let status = tokio::task::block_in_place(|| old.proc.wait_exit(Duration::from_secs(10)))
            .expect("a draining balancer exits");
        assert!(status.success(), "{status:?}");
        drop(old);
        let new = Balancer::start_on(inference, management, &args).await;
        new.wait_eligible(4).await;
        // Back in HAProxy's rotation (two good checks) before the next one
        // goes: served some requests.
        wait_for(
            "the restarted balancer in rotation",
            Duration::from_secs(10),
            || async { (new.in_flight().await > 0).then_some(()) },
        )
        .await;
        restarted.push(new);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let outcomes = load.finish().await;
    let failed: Vec<_> = outcomes.iter().filter(|(_, _, s)| *s != 200).collect();
    assert!(
        failed.is_empty(),
        "{} of {} failed: {failed:?}",
        failed.len(),
        outcomes.len()
    );
    assert!(outcomes.len() > 50, "only {} requests", outcomes.len());
    assert_never_overcommitted(&sims).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_spread_by_haproxy_over_both_balancers_stays_on_one_server() {
    // Four slots: each balancer's share of a server's slots is never 0
    // while the other runs a turn there (with two, the other may hold both
    // for a report interval: then a turn goes elsewhere rather than wait).
    let (a, b, sims, _agents, front) = two_behind(Kind::Haproxy, "4", &[]).await;
    for conv in 0..4 {
        six_turns_stay_on_one_server(&sims, conv, |_| front.url("/v1/chat/completions")).await;
    }
    // HAProxy did spread them.
    for x in [&a, &b] {
        let served = metric(x, "flowgate_requests_total", &[("code", "200")]).await;
        assert!(served >= 6.0, "a balancer served only {served} of 24");
    }
}
