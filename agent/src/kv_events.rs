//! The engine's KV-cache events (`--kv-events`): what vLLM and SGLang say
//! they store and evict, kept in an index per engine and reported to
//! every balancer.
//!
//! The engine publishes on a ZeroMQ PUB socket (data-parallel rank `r` on
//! the port plus `r`) multipart messages `[topic, seq (8 bytes, big
//! endian), msgpack batch]`, and answers on a ROUTER replay socket (its
//! port plus `r` too) a request `[b"", start seq]` with `[b"", seq,
//! batch]` for every batch it still buffers from there, then `[b"", -1,
//! b""]`. Each rank has a task of its own on a thread of its own (the
//! reports never wait on the events, whatever their rate): it applies the
//! batches in order ([`flowgate::kv_events::EngineIndex`]), replays a gap
//! it sees, and drops the rank's index when a gap cannot be replayed. A
//! frame that does not decode is counted, logged at most every
//! [`LOG_EVERY`] and skipped.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use flowgate::kv_events::{
    decode_batch, BlocksUpdate, BlocksVersion, Change, EngineIndex, Holdings, IndexStats, Medium,
    Order, KEY_VERSION,
};
use flowgate::protocol::KvEventsReport;
use tracing::{info, warn};
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

/// How often one kind of problem is logged at most.
pub const LOG_EVERY: Duration = Duration::from_secs(10);

/// How long a replay may take to answer each batch before the gap counts
/// as lost.
const REPLAY_TIMEOUT: Duration = Duration::from_secs(2);

/// Where the engine publishes, and how much the agent keeps.
#[derive(Debug, Clone)]
pub struct KvEventsConfig {
    /// `host:port` of rank 0's PUB socket.
    pub publisher: (String, u16),
    /// `host:port` of rank 0's replay socket, if it has one.
    pub replay: Option<(String, u16)>,
    pub topic: String,
    pub ranks: u16,
    /// Blocks kept per rank, least recently stored forgotten first.
    pub capacity_blocks: usize,
}

/// Counters the ranks' indexes do not keep.
#[derive(Debug, Clone, Copy, Default)]
struct Wire {
    undecodable: u64,
    replays: u64,
}

/// The ranks' indexes and their union, shared with the reports.
#[derive(Debug)]
pub struct KvState {
    ranks: Vec<EngineIndex>,
    holdings: Holdings,
    wire: Wire,
}

pub type SharedKv = Arc<Mutex<KvState>>;

impl KvState {
    fn new(config: &KvEventsConfig, epoch: u64) -> Self {
        KvState {
            ranks: (0..config.ranks)
                .map(|_| EngineIndex::new(config.capacity_blocks))
                .collect(),
            holdings: Holdings::new(epoch),
            wire: Wire::default(),
        }
    }

    /// The engine's KV capacity, from its metrics: how many stores turn
    /// its cache over (a rank that lost events is whole again after).
    pub fn set_capacity_tokens(&mut self, tokens: Option<u64>) {
        for index in &mut self.ranks {
            let blocks = tokens
                .zip(index.block_size())
                .map(|(t, b)| t / u64::from(b));
            index.set_engine_blocks(blocks);
        }
    }

    /// What the blocks a balancer holding `seen` lacks (`None`: none).
    pub fn update_since(&self, seen: Option<BlocksVersion>) -> Option<BlocksUpdate> {
        self.holdings.since(seen)
    }

    /// What a report says of the events.
    pub fn report(&self, now: Instant) -> KvEventsReport {
        let mut stats = IndexStats::default();
        for index in &self.ranks {
            let s = index.stats();
            stats.batches += s.batches;
            stats.events += s.events;
            stats.gaps += s.gaps;
            stats.lost += s.lost;
            stats.restarts += s.restarts;
            stats.skipped_unknown_type += s.skipped_unknown_type;
            stats.skipped_unknown_medium += s.skipped_unknown_medium;
            stats.skipped_malformed += s.skipped_malformed;
            stats.orphans += s.orphans;
        }
        let last = self.ranks.iter().filter_map(EngineIndex::last_batch).max();
        KvEventsReport {
            key_version: KEY_VERSION,
            block_size: self.ranks.iter().find_map(EngineIndex::block_size),
            whole: self.ranks.iter().all(EngineIndex::is_whole),
            blocks_gpu: self.holdings.len_on(Medium::Gpu) as u64,
            blocks_cpu: self.holdings.len_on(Medium::Cpu) as u64,
            batches: stats.batches,
            events: stats.events,
            gaps: stats.gaps,
            replays: self.wire.replays,
            resyncs: stats.lost,
            restarts: stats.restarts,
            skipped: stats.skipped_unknown_type
                + stats.skipped_unknown_medium
                + stats.skipped_malformed
                + stats.orphans
                + self.wire.undecodable,
            last_batch_ms_ago: last.map(|t| now.saturating_duration_since(t).as_millis() as u64),
        }
    }
}

/// Starts the subscriber (module docs) on a thread of its own; the state
/// it keeps is shared with the reports.
pub fn spawn(config: KvEventsConfig) -> SharedKv {
    let epoch = uuid::Uuid::new_v4().as_u64_pair().0;
    let shared = Arc::new(Mutex::new(KvState::new(&config, epoch)));
    let state = shared.clone();
    std::thread::Builder::new()
        .name("kv-events".into())
        .spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("tokio runtime");
            runtime.block_on(async move {
                let mut ranks = Vec::new();
                for rank in 0..config.ranks {
                    ranks.push(tokio::spawn(follow(config.clone(), rank, state.clone())));
                }
                for r in ranks {
                    let _ = r.await;
                }
            });
        })
        .expect("spawn the kv-events thread");
    shared
}

fn endpoint((host, port): &(String, u16), rank: u16) -> String {
    let port = port.saturating_add(rank);
    if host.contains(':') {
        format!("tcp://[{host}]:{port}")
    } else {
        format!("tcp://{host}:{port}")
    }
}

/// Logs one kind of problem at most every [`LOG_EVERY`].
#[derive(Default)]
struct Throttle(Option<Instant>);

impl Throttle {
    fn ready(&mut self) -> bool {
        let now = Instant::now();
        if self.0.is_some_and(|t| now.duration_since(t) < LOG_EVERY) {
            return false;
        }
        self.0 = Some(now);
        true
    }
}

/// Follows one rank's events for the life of the agent.
async fn follow(config: KvEventsConfig, rank: u16, state: SharedKv) {
    let publisher = endpoint(&config.publisher, rank);
    let replay = config.replay.as_ref().map(|r| endpoint(r, rank));
    let mut undecodable = Throttle::default();
    let mut lost = Throttle::default();
    loop {
        let mut socket = SubSocket::new();
        if let Err(e) = socket.connect(&publisher).await {
            warn!(%publisher, error = %e, "kv events: cannot connect; trying again");
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue;
        }
        if let Err(e) = socket.subscribe(&config.topic).await {
            warn!(%publisher, error = %e, "kv events: cannot subscribe; trying again");
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue;
        }
        info!(%publisher, rank, "kv events: subscribed");
        loop {
            let message = match socket.recv().await {
                Ok(m) => m,
                // The engine went away: the socket reconnects by itself.
                Err(_) => continue,
            };
            let Some((seq, payload)) = seq_and_payload(message) else {
                count_undecodable(
                    &state,
                    &mut undecodable,
                    &publisher,
                    "a message is not [topic, seq, batch]",
                );
                continue;
            };
            take(
                &state,
                rank,
                seq,
                &payload,
                replay.as_deref(),
                &mut undecodable,
                &mut lost,
                &publisher,
            )
            .await;
        }
    }
}

/// A PUB message's sequence number and payload: its last two frames.
fn seq_and_payload(message: ZmqMessage) -> Option<(u64, Bytes)> {
    let mut frames = message.into_vec();
    let payload = frames.pop()?;
    let seq = frames.pop()?;
    let seq: [u8; 8] = seq.as_ref().try_into().ok()?;
    Some((u64::from_be_bytes(seq), payload))
}

fn count_undecodable(state: &SharedKv, throttle: &mut Throttle, from: &str, why: &str) {
    state.lock().expect("kv state").wire.undecodable += 1;
    if throttle.ready() {
        warn!(publisher = from, "kv events: skipped a frame: {why}");
    }
}

/// Takes batch `seq` of `rank`: in order, after replaying what was missed
/// before it (module docs).
#[allow(clippy::too_many_arguments)]
async fn take(
    state: &SharedKv,
    rank: u16,
    seq: u64,
    payload: &[u8],
    replay: Option<&str>,
    undecodable: &mut Throttle,
    lost: &mut Throttle,
    publisher: &str,
) {
    loop {
        let order = state.lock().expect("kv state").ranks[rank as usize].order(seq);
        match order {
            Order::Next => break,
            Order::Restarted => {
                info!(
                    publisher,
                    rank, "kv events: the engine restarted (its numbering went back)"
                );
                let mut s = state.lock().expect("kv state");
                let KvState {
                    ranks, holdings, ..
                } = &mut *s;
                ranks[rank as usize].restarted(&mut |c: Change| holdings.change(c));
                // Asked again: batches 0.. of its new run before this one
                // may be in its ring.
            }
            Order::Missed { from } => {
                if let Some(replay) = replay {
                    state.lock().expect("kv state").wire.replays += 1;
                    replay_range(state, rank, replay, from, seq, undecodable, publisher).await;
                }
                let mut s = state.lock().expect("kv state");
                let KvState {
                    ranks, holdings, ..
                } = &mut *s;
                let index = &mut ranks[rank as usize];
                if index.order(seq) != Order::Next {
                    if lost.ready() {
                        warn!(
                            publisher,
                            rank,
                            from,
                            to = seq,
                            "kv events: batches missed and not replayed: the engine's index is \
                             dropped and rebuilt from its next events"
                        );
                    }
                    index.lost(seq, &mut |c: Change| holdings.change(c));
                }
                break;
            }
        }
    }
    apply(state, rank, seq, payload, undecodable, publisher);
}

fn apply(
    state: &SharedKv,
    rank: u16,
    seq: u64,
    payload: &[u8],
    undecodable: &mut Throttle,
    publisher: &str,
) {
    match decode_batch(payload) {
        Ok(batch) => {
            let mut s = state.lock().expect("kv state");
            let KvState {
                ranks, holdings, ..
            } = &mut *s;
            ranks[rank as usize].apply(seq, &batch, Instant::now(), &mut |c: Change| {
                holdings.change(c)
            });
        }
        Err(e) => {
            let mut s = state.lock().expect("kv state");
            s.ranks[rank as usize].skip(seq);
            drop(s);
            count_undecodable(state, undecodable, publisher, &e.to_string());
        }
    }
}

/// Asks the replay socket for batches `from..to` and applies them.
#[allow(clippy::too_many_arguments)]
async fn replay_range(
    state: &SharedKv,
    rank: u16,
    replay: &str,
    from: u64,
    to: u64,
    undecodable: &mut Throttle,
    publisher: &str,
) {
    let mut socket = DealerSocket::new();
    let asked = async {
        socket.connect(replay).await?;
        let mut request = ZmqMessage::from(Bytes::new());
        request.push_back(Bytes::copy_from_slice(&from.to_be_bytes()));
        socket.send(request).await
    };
    if tokio::time::timeout(REPLAY_TIMEOUT, asked).await.is_err() {
        return;
    }
    while let Ok(Ok(message)) = tokio::time::timeout(REPLAY_TIMEOUT, socket.recv()).await {
        let Some((seq, payload)) = seq_and_payload(message) else {
            return;
        };
        // -1: the end of what the ring holds.
        if seq == u64::MAX || seq >= to {
            return;
        }
        let wanted = {
            let s = state.lock().expect("kv state");
            let index = &s.ranks[rank as usize];
            index.wants(seq) && index.order(seq) == Order::Next
        };
        if wanted {
            apply(state, rank, seq, &payload, undecodable, publisher);
        }
    }
}
