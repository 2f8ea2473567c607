//! The balancers an agent reports to.
//!
//! `--management-addr` names one or more balancers (repeatable, or a
//! comma-separated list). A DNS name counts as one balancer per address it
//! resolves to and is resolved again every [`RESOLVE_EVERY`], so a
//! Kubernetes headless Service (one address per balancer pod) just works: a
//! new pod gets reports within one interval of appearing in DNS, a pod that
//! left stops getting them. A name that fails to resolve keeps the
//! addresses it had. Lookups run in a task of their own ([`resolver`]),
//! each bounded, so a slow DNS server delays no report either.
//!
//! Each balancer has a task of its own that sends it the latest report
//! (with the client's timeout), so a slow or dead balancer never delays the
//! others: while one is stuck, the reports it missed are skipped, not
//! queued. The main loop publishes one report per interval and reads back
//! what each balancer answered.
//!
//! The server's slots are divided between the balancers
//! ([`flowgate::shares`]): each answer says the balancer's demand, and each
//! report carries its share (`slot_share`), so all balancers together never
//! send the server more than its slots. A balancer that accepted none of
//! the last [`FORGET_AFTER`] reports (stopped, or unreachable), or whose
//! port refused the last one (killed: no balancer runs there now), is left
//! out of the division: its requests still running count as busy slots no
//! balancer sent. So a killed balancer's share moves to the others within
//! two report intervals.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use flowgate::kv_events::{BlocksUpdate, BlocksVersion};
use flowgate::shares::{Demand, Ledger};
use flowgate::AgentReport;
use reqwest::Client;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{info, warn};

use crate::kv_events::SharedKv;
use crate::loader::AdapterLoader;

/// How often the balancers' names are resolved again.
pub const RESOLVE_EVERY: Duration = Duration::from_secs(5);

/// Reports in a row a balancer may leave unanswered before its share goes
/// to the others.
pub const FORGET_AFTER: u64 = 2;

/// A report, numbered in the order it was published, when the engine read
/// behind it began and ended, and each balancer's share of the slots
/// (`None`: the agent does not divide them).
type Published = Option<(u64, Arc<AgentReport>, Read, Option<Shares>)>;

/// When a read of the engine began and ended.
pub type Read = (Instant, Instant);

/// Each balancer's share of the slots.
type Shares = Arc<BTreeMap<SocketAddr, u32>>;

/// Why a report was not accepted.
#[derive(Debug)]
struct Failure {
    /// The connection was refused: nothing listens on the balancer's port
    /// (a balancer that hangs still accepts connections).
    refused: bool,
    message: String,
}

/// What one balancer answered.
#[derive(Debug, Default)]
struct Answer {
    /// To the last report it got: the report's number, and its demand on
    /// the endpoint or why it failed.
    last: Option<(u64, Result<Demand, Failure>)>,
    /// The last report it accepted, the engine's busy slots that report
    /// said, and its demand then. A balancer that refuses or fails every
    /// report (one killed: its port refuses at once) has none newer, and
    /// leaves the division.
    accepted: Option<(u64, u32, Demand)>,
}

/// The names given (`host:port`), split from every `--management-addr`.
pub fn names(args: &[String]) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    for arg in args {
        for part in arg.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let base = crate::base_url(part)?;
            let hostport = base.trim_start_matches("http://");
            if !out.iter().any(|n| n == hostport) {
                out.push(hostport.to_string());
            }
        }
    }
    if out.is_empty() {
        return Err("--management-addr names no balancer".into());
    }
    Ok(out)
}

/// The addresses each balancer name resolves to.
pub type Resolved = BTreeMap<String, BTreeSet<SocketAddr>>;

/// The longest one lookup may take.
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(2);

/// Resolves `names` now and every [`RESOLVE_EVERY`] in a task of its own
/// (a slow DNS server delays no report), keeping a name's last addresses
/// when a lookup fails, times out or finds none.
pub fn resolver(names: Vec<String>) -> watch::Receiver<Resolved> {
    let (tx, rx) = watch::channel(Resolved::new());
    tokio::spawn(async move {
        let mut resolved = Resolved::new();
        let mut every = tokio::time::interval(RESOLVE_EVERY);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            every.tick().await;
            for name in &names {
                let looked_up =
                    tokio::time::timeout(LOOKUP_TIMEOUT, tokio::net::lookup_host(name.as_str()))
                        .await
                        .map_err(|_| "no answer in time".to_string())
                        .and_then(|r| r.map_err(|e| e.to_string()))
                        .map(|addrs| addrs.collect::<BTreeSet<SocketAddr>>());
                match looked_up {
                    Ok(addrs) if !addrs.is_empty() => {
                        resolved.insert(name.clone(), addrs);
                    }
                    Ok(_) => warn!(
                        balancer = name,
                        "resolves to no address; keeping the last ones"
                    ),
                    Err(e) => warn!(
                        balancer = name,
                        "cannot resolve ({e}); keeping the last addresses"
                    ),
                }
            }
            if tx.send(resolved.clone()).is_err() {
                return;
            }
        }
    });
    rx
}

/// One balancer's reporting task and what it last heard.
struct Balancer {
    task: JoinHandle<()>,
    answer: Arc<Mutex<Answer>>,
    /// The number of the last report published before it was added.
    added_after: u64,
}

/// Every balancer reported to, by address.
pub struct Balancers {
    by_addr: BTreeMap<SocketAddr, Balancer>,
    client: Client,
    agent_id: String,
    token: Option<String>,
    latest: watch::Sender<Published>,
    published: u64,
    /// The slots' division between the balancers, unless off.
    shares: Option<Ledger<SocketAddr>>,
    side: EngineSide,
}

/// What the agent does at the engine for the balancers besides reporting.
#[derive(Clone, Default)]
pub struct EngineSide {
    /// Loads LoRA adapters the balancers ask for (`--lora-adapter`).
    pub loader: Option<Arc<AdapterLoader>>,
    /// The engine's blocks, from its KV-cache events (`--kv-events`).
    pub kv: Option<SharedKv>,
}

impl Balancers {
    pub fn new(
        client: Client,
        agent_id: String,
        token: Option<String>,
        share: bool,
        side: EngineSide,
    ) -> Self {
        Balancers {
            side,
            by_addr: BTreeMap::new(),
            client,
            agent_id,
            token,
            latest: watch::channel(None).0,
            published: 0,
            shares: share.then(Ledger::default),
        }
    }

    /// Starts or stops balancers to match what the names resolve to now.
    pub fn apply(&mut self, resolved: &Resolved) {
        let wanted: BTreeSet<SocketAddr> = resolved.values().flatten().copied().collect();
        let gone: Vec<SocketAddr> = (self.by_addr.keys())
            .filter(|a| !wanted.contains(a))
            .copied()
            .collect();
        for addr in gone {
            if let Some(shares) = &mut self.shares {
                shares.forget(&addr);
            }
            if let Some(b) = self.by_addr.remove(&addr) {
                b.task.abort();
                info!(balancer = %addr, "no longer named: not reported to any more");
            }
        }
        for addr in wanted {
            if !self.by_addr.contains_key(&addr) {
                info!(balancer = %addr, "reporting to it");
                let answer = Arc::new(Mutex::new(Answer::default()));
                let task = tokio::spawn(report_to(
                    addr,
                    self.client.clone(),
                    self.url(addr),
                    self.token.clone(),
                    self.latest.subscribe(),
                    Arc::clone(&answer),
                    self.side.clone(),
                ));
                let added_after = self.published;
                self.by_addr.insert(
                    addr,
                    Balancer {
                        task,
                        answer,
                        added_after,
                    },
                );
            }
        }
    }

    fn url(&self, addr: SocketAddr) -> String {
        format!("http://{addr}/api/v1/agents/{}", self.agent_id)
    }

    /// Divides the slots by what the balancers last answered, and hands
    /// `report` (from the engine `read`) with each one's share to every
    /// balancer's task; returns its number.
    pub fn publish(&mut self, mut report: AgentReport, read: Read) -> u64 {
        self.published += 1;
        // Every balancer named, answering or not: one that stopped may be
        // back at any moment, and until it is left out of the division the
        // others still share the fleet with it.
        report.balancers = Some(u32::try_from(self.by_addr.len()).unwrap_or(u32::MAX));
        let shares = self.shares.as_mut().map(|ledger| {
            for (addr, b) in &self.by_addr {
                let answer = b.answer.lock().unwrap_or_else(|e| e.into_inner());
                let accepted = answer.accepted;
                let refused = matches!(&answer.last, Some((_, Err(f))) if f.refused);
                drop(answer);
                // The last report it accepted, or when it was added.
                let heard = accepted.map_or(b.added_after, |(n, _, _)| n);
                match accepted {
                    _ if refused || heard + FORGET_AFTER < self.published => ledger.forget(addr),
                    // Its demand then; a failure since leaves it standing.
                    Some((_, busy, demand)) => ledger.answered(addr, busy, demand),
                    // A balancer not heard from yet joins idle.
                    None => ledger.joined(addr),
                }
            }
            Arc::new(
                ledger
                    .divide(report.slots_total, report.slots_busy)
                    .into_iter()
                    .collect(),
            )
        });
        self.latest
            .send_replace(Some((self.published, Arc::new(report), read, shares)));
        self.published
    }

    /// Whether every balancer answered a report numbered `since` or later
    /// with no request in flight to the endpoint, or failed to answer it
    /// (a balancer that cannot be reached sends the server nothing).
    pub fn all_idle_since(&self, since: u64) -> bool {
        self.by_addr.values().all(|b| {
            match &b.answer.lock().unwrap_or_else(|e| e.into_inner()).last {
                Some((n, Ok(demand))) => *n >= since && demand.in_flight == 0,
                Some((n, Err(_))) => *n >= since,
                None => false,
            }
        })
    }

    /// Deregisters from every balancer at once, each within `timeout`.
    pub async fn deregister(&self, timeout: Duration) {
        let calls = self.by_addr.keys().map(|addr| {
            let req = authorized(self.client.delete(self.url(*addr)), &self.token);
            let addr = *addr;
            async move {
                match tokio::time::timeout(timeout, req.send()).await {
                    Ok(Ok(r)) if r.status().is_success() => info!(balancer = %addr, "deregistered"),
                    Ok(Ok(r)) => {
                        warn!(balancer = %addr, "deregistration answered HTTP {}", r.status())
                    }
                    Ok(Err(e)) => warn!(balancer = %addr, "could not deregister: {e}"),
                    Err(_) => warn!(balancer = %addr, "could not deregister: no answer in time"),
                }
            }
        });
        futures_util::future::join_all(calls).await;
    }
}

impl Drop for Balancers {
    fn drop(&mut self) {
        for b in self.by_addr.values() {
            b.task.abort();
        }
    }
}

fn authorized(req: reqwest::RequestBuilder, token: &Option<String>) -> reqwest::RequestBuilder {
    match token {
        Some(token) => req.bearer_auth(token),
        None => req,
    }
}

/// Sends each newly published report to the balancer at `addr`, the
/// latest one when several came while it was busy.
async fn report_to(
    addr: SocketAddr,
    client: Client,
    url: String,
    token: Option<String>,
    mut latest: watch::Receiver<Published>,
    answer: Arc<Mutex<Answer>>,
    side: EngineSide,
) {
    let EngineSide { loader, kv } = side;
    let mut failing = false;
    // The engine's blocks this balancer holds, as it last said (in its
    // answer to each report, and to each update).
    let mut blocks_seen: Option<BlocksVersion> = None;
    let mut blocks_failing = false;
    while latest.changed().await.is_ok() {
        let Some((n, report, (began, ended), shares)) = latest.borrow_and_update().clone() else {
            continue;
        };
        let mut report = (*report).clone();
        // Left out of the division (it stopped answering): no slots.
        report.slot_share = shares.map(|s| s.get(&addr).copied().unwrap_or(0));
        // As late as can be: a report that waited for a slow balancer
        // says so. The beginning rounded up, the end down: the balancer
        // counts every request of its own the engine may have seen.
        report.read_began_ms_ago = Some(began.elapsed().as_micros().div_ceil(1_000) as u64);
        report.read_ended_ms_ago = Some(ended.elapsed().as_millis() as u64);
        let result = send(&client, &url, &token, &report)
            .await
            .map(|(demand, load, blocks)| {
                if let Some(l) = loader.as_ref().filter(|_| !load.is_empty()) {
                    l.ask(&load);
                }
                blocks_seen = blocks;
                demand
            });
        match (&result, failing) {
            (Err(e), false) => warn!(balancer = %addr, "{}", e.message),
            (Ok(_), true) => info!(balancer = %addr, "reports accepted again"),
            _ => {}
        }
        failing = result.is_err();
        let accepted = result.is_ok();
        {
            let mut answer = answer.lock().unwrap_or_else(|e| e.into_inner());
            if let Ok(demand) = &result {
                answer.accepted = Some((n, report.slots_busy, *demand));
            }
            answer.last = Some((n, result));
        }
        // The blocks it lacks, once it took the report (which registers
        // the agent): a delta since what it holds, or a snapshot.
        let Some(kv) = kv.as_ref().filter(|_| accepted) else {
            continue;
        };
        let update = kv
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .update_since(blocks_seen);
        if let Some(update) = update {
            match send_blocks(&client, &url, &token, &update).await {
                Ok(held) => {
                    if blocks_failing {
                        info!(balancer = %addr, "blocks accepted again");
                    }
                    blocks_failing = false;
                    blocks_seen = held;
                }
                Err(e) => {
                    if !blocks_failing {
                        warn!(balancer = %addr, "{e}");
                    }
                    blocks_failing = true;
                }
            }
        }
    }
}

/// Sends an update of the engine's blocks; returns what the balancer
/// holds after it (`None`: nothing of this agent's, so a snapshot next).
async fn send_blocks(
    client: &Client,
    url: &str,
    token: &Option<String>,
    update: &BlocksUpdate,
) -> Result<Option<BlocksVersion>, String> {
    let resp = authorized(client.post(format!("{url}/blocks")), token)
        .header(reqwest::header::CONTENT_TYPE, "application/octet-stream")
        .body(update.encode())
        .send()
        .await
        .map_err(|e| format!("balancer unreachable for blocks: {e}"))?;
    let status = resp.status();
    let body = resp.text().await.unwrap_or_default();
    // 409: the update did not apply to what it holds, which it says.
    if status.is_success() || status == reqwest::StatusCode::CONFLICT {
        #[derive(serde::Deserialize)]
        struct Held {
            held: Option<BlocksVersion>,
        }
        return serde_json::from_str::<Held>(&body)
            .map(|h| h.held)
            .map_err(|e| format!("balancer answered blocks with {body:?}: {e}"));
    }
    Err(format!(
        "balancer refused the blocks: HTTP {status}: {body}"
    ))
}

/// Sends a report; returns the balancer's demand on the endpoint (what
/// it does not say counts as 0) and the adapters it asks to load.
async fn send(
    client: &Client,
    url: &str,
    token: &Option<String>,
    report: &AgentReport,
) -> Result<(Demand, Vec<String>, Option<BlocksVersion>), Failure> {
    let resp = authorized(client.post(format!("{url}/report")), token)
        .json(report)
        .send()
        .await
        .map_err(|e| Failure {
            refused: e.is_connect() && !e.is_timeout(),
            message: format!("balancer unreachable: {e}"),
        })?;
    let status = resp.status();
    let body = resp.text().await.unwrap_or_default();
    if status.is_success() {
        let v = serde_json::from_str::<serde_json::Value>(&body).unwrap_or_default();
        let count = |key: &str| {
            v[key]
                .as_u64()
                .map(|n| u32::try_from(n).unwrap_or(u32::MAX))
        };
        let demand = Demand {
            in_flight: count("in_flight").unwrap_or(0),
            queued: count("queued").unwrap_or(0),
            applied: count("slot_share"),
            at_read: count("in_flight_at_read"),
        };
        let load = (v["load_adapters"].as_array().into_iter().flatten())
            .filter_map(|n| n.as_str().map(str::to_string))
            .collect();
        // The engine's blocks it holds (a restarted balancer: none).
        let blocks = serde_json::from_value(v["blocks_held"].clone()).ok();
        Ok((demand, load, blocks))
    } else {
        Err(Failure {
            refused: false,
            message: format!("balancer refused the report: HTTP {status}: {body}"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_split_checked_and_deduplicated() {
        let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            names(&args(&["127.0.0.1:8060", "http://b:1/, c:2", "b:1"])),
            Ok(vec!["127.0.0.1:8060".into(), "b:1".into(), "c:2".into()])
        );
        assert!(names(&args(&["https://b:1"])).is_err());
        assert!(names(&args(&["b"])).is_err());
        assert!(names(&args(&["http://b:1/x"])).is_err());
        assert!(names(&args(&[" , "])).is_err());
    }

    fn report() -> AgentReport {
        serde_json::from_value(serde_json::json!({
            "protocol_version": flowgate::PROTOCOL_VERSION, "agent_id": "a", "name": "a",
            "backend": "llamacpp", "external_addr": "127.0.0.1:9", "models": [],
            "health": "ready", "slots_total": 4, "slots_busy": 0, "requests_waiting": 0,
            "monitoring_interval_ms": 1000
        }))
        .unwrap()
    }

    #[tokio::test]
    async fn every_report_says_how_many_balancers_it_goes_to() {
        let mut b = Balancers::new(Client::new(), "a".into(), None, true, EngineSide::default());
        let said = |b: &Balancers| {
            let latest = b.latest.borrow();
            latest.as_ref().map(|(_, r, _, _)| r.balancers)
        };
        // Ports nothing listens on: named balancers count, answering or not.
        let mut resolved = Resolved::new();
        resolved.insert("one".into(), ["127.0.0.1:9".parse().unwrap()].into());
        b.apply(&resolved);
        b.publish(report(), (Instant::now(), Instant::now()));
        assert_eq!(said(&b), Some(Some(1)));
        resolved.insert("two".into(), ["127.0.0.1:10".parse().unwrap()].into());
        b.apply(&resolved);
        b.publish(report(), (Instant::now(), Instant::now()));
        assert_eq!(said(&b), Some(Some(2)));
    }
}
