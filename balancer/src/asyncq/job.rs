//! One async request as the queue keeps it: its states, the queue's
//! settings, what a delivery that failed does to it, and the errors of the
//! stores that keep it ([`super::store`]).
//!
//! A request is `queued` until the dispatcher leases it (`dispatched`, with a
//! visibility lease of `max_idle`). It ends `succeeded` or `failed` (the
//! fleet's answer is kept), `cancelled`, `expired` (its deadline passed while
//! queued) or `evicted` (pushed out by `auto_evict`). A lease that runs out,
//! or a dispatch that failed on the way, delivers it again, up to
//! `max_delivery` times; then the dead-letter policy applies: `drop` marks it
//! `dead_lettered` (kept, visible), `rear` puts it back at the end of the
//! queue with a fresh count. Finished requests are purged after `retention`.

use std::time::Duration;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Queued,
    Dispatched,
    Succeeded,
    Failed,
    DeadLettered,
    Cancelled,
    Expired,
    Evicted,
}

impl Status {
    pub fn is_final(self) -> bool {
        !matches!(self, Status::Queued | Status::Dispatched)
    }
}

/// What to do with a request delivered `max_delivery` times.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum DeadLetter {
    /// Keep it, marked `dead_lettered`.
    Drop,
    /// Back to the end of the queue with a fresh delivery count.
    Rear,
}

#[derive(Debug, Clone, PartialEq)]
pub struct QueueConfig {
    /// Queued requests at most (over: refused, or the oldest evicted).
    pub max_length: usize,
    /// Largest request body.
    pub max_payload_bytes: usize,
    /// Deliveries before the dead-letter policy applies.
    pub max_delivery: u32,
    /// Visibility lease: a dispatch not finished within it is redelivered.
    pub max_idle: Duration,
    pub dead_letter: DeadLetter,
    /// How long finished requests (and their answers) are kept.
    pub retention: Duration,
    /// Evict the oldest queued request instead of refusing a new one.
    pub auto_evict: bool,
    /// Finished requests kept at most: while as many are kept, the
    /// dispatcher takes no new work (answers are never dropped early).
    pub max_results: u64,
    /// How long Batch API files (uploads without `expires_after`, and
    /// batch output) and finished batches are kept.
    pub file_retention: Duration,
}

impl QueueConfig {
    /// Refuses a submission with a body over `max_payload_bytes`.
    pub(super) fn check_payloads(&self, new: &[(NewJob, String)]) -> Result<()> {
        if new
            .iter()
            .any(|(j, _)| j.body.len() > self.max_payload_bytes)
        {
            return Err(StoreError::TooLarge(self.max_payload_bytes));
        }
        Ok(())
    }

    /// Applies a failed delivery to `job` (its error, and its count unless
    /// the fleet merely had no room) and says where it goes: past its
    /// deadline it expires; under `max_delivery` it is queued again; then
    /// the dead-letter policy. Sets its status; both stores follow it.
    pub(super) fn redelivery(
        &self,
        job: &mut Job,
        error: &str,
        counted: bool,
        now_ms: u64,
    ) -> Redelivery {
        job.last_error = Some(error.to_string());
        if !counted {
            job.attempts -= 1;
        }
        job.updated_ms = now_ms;
        if job.deadline_ms.is_some_and(|d| d <= now_ms) {
            job.status = Status::Expired;
            return Redelivery::Finished;
        }
        if job.attempts < self.max_delivery {
            job.status = Status::Queued;
            return Redelivery::Again;
        }
        match self.dead_letter {
            DeadLetter::Drop => {
                job.status = Status::DeadLettered;
                Redelivery::Finished
            }
            DeadLetter::Rear => {
                job.attempts = 0;
                job.status = Status::Queued;
                Redelivery::Rear
            }
        }
    }
}

impl Default for QueueConfig {
    fn default() -> Self {
        QueueConfig {
            max_length: 100_000,
            max_payload_bytes: 16 << 20,
            max_delivery: 5,
            max_idle: Duration::from_secs(300),
            dead_letter: DeadLetter::Drop,
            retention: Duration::from_secs(24 * 3600),
            file_retention: Duration::from_secs(30 * 24 * 3600),
            auto_evict: false,
            max_results: 1_000_000,
        }
    }
}

/// The fleet's answer to a finished request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Answer {
    pub status: u16,
    pub body: String,
}

impl Answer {
    /// The final state it gives its request: `succeeded` for a 2xx.
    pub fn outcome(&self) -> Status {
        if (200..300).contains(&self.status) {
            Status::Succeeded
        } else {
            Status::Failed
        }
    }
}

/// Where a request goes after a failed delivery (see
/// [`QueueConfig::redelivery`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Redelivery {
    /// Final (`expired` or `dead_lettered`).
    Finished,
    /// Queued again at its place.
    Again,
    /// Queued again at the back, with a fresh count (`rear`).
    Rear,
}

/// One async request as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Job {
    pub id: String,
    /// The OpenAI path it is for, e.g. `/v1/chat/completions`.
    pub path: String,
    pub body: String,
    pub fairness_id: String,
    /// Among queued async requests, higher goes first.
    #[serde(default)]
    pub priority: i32,
    pub idempotency_key: Option<String>,
    /// Unix ms after which a still-queued request expires.
    pub deadline_ms: Option<u64>,
    /// Its session, hashed (never the key), delivered with it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
    pub status: Status,
    /// Deliveries so far (since the last `rear` dead-lettering).
    pub attempts: u32,
    pub created_ms: u64,
    pub updated_ms: u64,
    pub answer: Option<Answer>,
    /// Why the last delivery failed, if it did.
    pub last_error: Option<String>,
    pub(super) seq: u64,
    /// Redis: the request's entry in the queue stream.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) stream_entry: Option<String>,
    /// Redis: when the current delivery's lease runs out (Unix ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) lease_until_ms: Option<u64>,
}

impl Job {
    /// A new queued request.
    pub(super) fn new(new: NewJob, id: String, now_ms: u64) -> Job {
        Job {
            id,
            path: new.path,
            body: new.body,
            fairness_id: new.fairness_id,
            priority: new.priority,
            idempotency_key: new.idempotency_key,
            deadline_ms: new.deadline_ms,
            session: new.session,
            status: Status::Queued,
            attempts: 0,
            created_ms: now_ms,
            updated_ms: now_ms,
            answer: None,
            last_error: None,
            seq: 0,
            stream_entry: None,
            lease_until_ms: None,
        }
    }
}

/// A request to queue.
#[derive(Debug, Clone, Default)]
pub struct NewJob {
    pub path: String,
    pub body: String,
    pub fairness_id: String,
    pub priority: i32,
    pub idempotency_key: Option<String>,
    pub deadline_ms: Option<u64>,
    /// Its session, hashed and scoped (16 hex digits), read from the
    /// submit's headers and body: delivered with it.
    pub session: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("the queue is full ({0} requests)")]
    Full(usize),
    #[error("the request body exceeds {0} bytes")]
    TooLarge(usize),
    #[error("queue store: {0}")]
    Storage(String),
    #[error("not a cursor this queue gave out")]
    BadCursor,
}

pub type Result<T> = std::result::Result<T, StoreError>;

/// Queue lengths for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    pub queued: u64,
    pub dispatched: u64,
    /// Finished requests kept (until retention ends).
    pub finished: u64,
    /// Creation time of the oldest queued request (Unix ms).
    pub oldest_queued_ms: Option<u64>,
}

/// Why a request whose lease ran out is delivered again.
pub(super) const LEASE_LOST: &str = "the lease ran out before the dispatch finished";

/// What [`Store::reclaim`] did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Reclaimed {
    /// Leases that ran out: delivered again.
    pub redelivered: Vec<String>,
    pub dead_lettered: Vec<String>,
    pub expired: Vec<String>,
    /// Finished requests past retention, deleted.
    pub purged: usize,
}

impl Reclaimed {
    /// Files a request whose lease ran out under what became of it.
    pub(super) fn record(&mut self, job: &Job) {
        let list = match job.status {
            Status::DeadLettered => &mut self.dead_lettered,
            Status::Expired => &mut self.expired,
            _ => &mut self.redelivered,
        };
        list.push(job.id.clone());
    }
}
