//! The embedded, durable store of async requests (redb: every change is one
//! ACID transaction, synced to disk before it returns, so nothing accepted is
//! lost when the process is killed).
//!
//! A request is `queued` until the dispatcher leases it (`dispatched`, with a
//! visibility lease of `max_idle`). It ends `succeeded` or `failed` (the
//! fleet's answer is kept), `cancelled`, `expired` (its deadline passed while
//! queued) or `evicted` (pushed out by `auto_evict`). A lease that runs out,
//! or a dispatch that failed on the way, delivers it again, up to
//! `max_delivery` times; then the dead-letter policy applies: `drop` marks it
//! `dead_lettered` (kept, visible), `rear` puts it back at the end of the
//! queue with a fresh count. Finished requests are purged after `retention`.

use std::path::Path;
use std::time::Duration;

use redb::{Database, ReadableDatabase, ReadableTable, ReadableTableMetadata, TableDefinition};
use serde::{Deserialize, Serialize};

/// id → the request as JSON.
const JOBS: TableDefinition<&str, &[u8]> = TableDefinition::new("jobs");
/// Arrival order (a sequence number) → id, for queued requests.
const QUEUE: TableDefinition<u64, &str> = TableDefinition::new("queue");
/// Lease order, (−priority, sequence number) → id: the same requests,
/// highest priority first, first come first within a priority.
const ORDER: TableDefinition<(i64, u64), &str> = TableDefinition::new("lease_order");
/// Idempotency key → id.
const KEYS: TableDefinition<&str, &str> = TableDefinition::new("idempotency_keys");
/// id → lease end (Unix ms), for dispatched requests.
const LEASES: TableDefinition<&str, u64> = TableDefinition::new("leases");
/// Finish order (a sequence number) → id: the results feed, and retention.
const FINISHED: TableDefinition<u64, &str> = TableDefinition::new("finished_order");
/// (deadline ms, queue seq) → id, for queued requests with a deadline.
const DEADLINES: TableDefinition<(u64, u64), &str> = TableDefinition::new("deadlines");
/// `kind/id` → bytes: the Batch API's files and batches.
const BLOBS: TableDefinition<&str, &[u8]> = TableDefinition::new("blobs");
/// Counters: `next_seq`, `next_finish`.
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");

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
    pub status: Status,
    /// Deliveries so far (since the last `rear` dead-lettering).
    pub attempts: u32,
    pub created_ms: u64,
    pub updated_ms: u64,
    pub answer: Option<Answer>,
    /// Why the last delivery failed, if it did.
    pub last_error: Option<String>,
    seq: u64,
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

macro_rules! redb_errors {
    ($($t:ty),*) => {$(
        impl From<$t> for StoreError {
            fn from(e: $t) -> Self {
                StoreError::Storage(redb::Error::from(e).to_string())
            }
        }
    )*};
}
redb_errors!(
    redb::Error,
    redb::DatabaseError,
    redb::TransactionError,
    redb::TableError,
    redb::StorageError,
    redb::CommitError
);

pub type Result<T> = std::result::Result<T, StoreError>;

fn encode(job: &Job) -> Vec<u8> {
    serde_json::to_vec(job).expect("a job serializes")
}

fn decode(bytes: &[u8]) -> Result<Job> {
    serde_json::from_slice(bytes).map_err(|e| StoreError::Storage(format!("corrupt job: {e}")))
}

/// Takes the next number of the counter `name`.
fn next_number(txn: &redb::WriteTransaction, name: &str) -> Result<u64> {
    let mut meta = txn.open_table(META)?;
    let n = meta.get(name)?.map_or(0, |v| v.value());
    meta.insert(name, n + 1)?;
    Ok(n)
}

fn order_key(job: &Job) -> (i64, u64) {
    (-i64::from(job.priority), job.seq)
}

/// Puts `job` in the queue (arrival and lease order).
fn put_queued(txn: &redb::WriteTransaction, job: &Job) -> Result<()> {
    txn.open_table(QUEUE)?.insert(job.seq, job.id.as_str())?;
    txn.open_table(ORDER)?
        .insert(order_key(job), job.id.as_str())?;
    Ok(())
}

/// Takes `job` out of the queue, if it is there.
fn take_queued(txn: &redb::WriteTransaction, job: &Job) -> Result<()> {
    txn.open_table(QUEUE)?.remove(job.seq)?;
    txn.open_table(ORDER)?.remove(order_key(job))?;
    Ok(())
}

/// Appends `id` to the finish order.
fn mark_finished(txn: &redb::WriteTransaction, id: &str) -> Result<()> {
    let n = next_number(txn, "next_finish")?;
    txn.open_table(FINISHED)?.insert(n, id)?;
    Ok(())
}

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

pub struct Store {
    db: Database,
    config: QueueConfig,
}

impl Store {
    /// Opens (or creates) the store in `dir`.
    pub fn open(dir: &Path, config: QueueConfig) -> Result<Store> {
        std::fs::create_dir_all(dir)
            .map_err(|e| StoreError::Storage(format!("cannot create {}: {e}", dir.display())))?;
        let db = Database::create(dir.join("async-queue.redb"))?;
        let txn = db.begin_write()?;
        {
            txn.open_table(JOBS)?;
            txn.open_table(QUEUE)?;
            txn.open_table(ORDER)?;
            txn.open_table(KEYS)?;
            txn.open_table(LEASES)?;
            txn.open_table(FINISHED)?;
            txn.open_table(DEADLINES)?;
            txn.open_table(BLOBS)?;
            txn.open_table(META)?;
        }
        txn.commit()?;
        Ok(Store { db, config })
    }

    /// One request (tests; the balancer goes through `Backend::submit`).
    #[cfg(test)]
    pub fn submit(&self, new: NewJob, id: String, now_ms: u64) -> Result<(Job, bool)> {
        let mut done = self.submit_many(vec![(new, id)], now_ms)?;
        Ok(done.pop().expect("one request in, one out"))
    }

    /// Queues several requests in one transaction: all or none. With an
    /// idempotency key already seen, a request is the one that key made
    /// (`false`: nothing new was queued).
    pub fn submit_many(&self, new: Vec<(NewJob, String)>, now_ms: u64) -> Result<Vec<(Job, bool)>> {
        self.config.check_payloads(&new)?;
        let txn = self.db.begin_write()?;
        let mut out = Vec::with_capacity(new.len());
        for (job, id) in new {
            out.push(self.insert(&txn, job, id, now_ms)?);
        }
        txn.commit()?;
        Ok(out)
    }

    fn insert(
        &self,
        txn: &redb::WriteTransaction,
        new: NewJob,
        id: String,
        now_ms: u64,
    ) -> Result<(Job, bool)> {
        let mut jobs = txn.open_table(JOBS)?;
        let mut keys = txn.open_table(KEYS)?;
        if let Some(key) = &new.idempotency_key {
            if let Some(existing) = keys.get(key.as_str())? {
                let existing = existing.value().to_string();
                if let Some(job) = jobs.get(existing.as_str())? {
                    return Ok((decode(job.value())?, false));
                }
            }
        }
        if txn.open_table(QUEUE)?.len()? as usize >= self.config.max_length {
            if !self.config.auto_evict {
                return Err(StoreError::Full(self.config.max_length));
            }
            // The oldest request of the lowest priority makes room.
            let oldest = {
                let order = txn.open_table(ORDER)?;
                let lowest = order.last()?.map(|(k, _)| k.value().0);
                let mut found = None;
                if let Some(rank) = lowest {
                    if let Some(entry) = order.range((rank, 0)..=(rank, u64::MAX))?.next() {
                        found = Some(entry?.1.value().to_string());
                    }
                }
                found
            };
            if let Some(oldest) = oldest {
                let evicted = jobs.get(oldest.as_str())?.map(|j| decode(j.value()));
                if let Some(mut evicted) = evicted.transpose()? {
                    take_queued(txn, &evicted)?;
                    evicted.status = Status::Evicted;
                    evicted.updated_ms = now_ms;
                    jobs.insert(oldest.as_str(), encode(&evicted).as_slice())?;
                    mark_finished(txn, &oldest)?;
                }
            }
        }
        let seq = next_number(txn, "next_seq")?;
        let job = Job {
            seq,
            ..Job::new(new, id, now_ms)
        };
        jobs.insert(job.id.as_str(), encode(&job).as_slice())?;
        put_queued(txn, &job)?;
        if let Some(deadline) = job.deadline_ms {
            txn.open_table(DEADLINES)?
                .insert((deadline, seq), job.id.as_str())?;
        }
        if let Some(key) = &job.idempotency_key {
            keys.insert(key.as_str(), job.id.as_str())?;
        }
        Ok((job, true))
    }

    /// Stores `bytes` as `id` of `kind` (Batch API files and batches).
    pub fn put_blob(&self, kind: &str, id: &str, bytes: &[u8]) -> Result<()> {
        let txn = self.db.begin_write()?;
        txn.open_table(BLOBS)?
            .insert(format!("{kind}/{id}").as_str(), bytes)?;
        txn.commit()?;
        Ok(())
    }

    pub fn delete_blob(&self, kind: &str, id: &str) -> Result<()> {
        let txn = self.db.begin_write()?;
        txn.open_table(BLOBS)?
            .remove(format!("{kind}/{id}").as_str())?;
        txn.commit()?;
        Ok(())
    }

    pub fn get_blob(&self, kind: &str, id: &str) -> Result<Option<Vec<u8>>> {
        let txn = self.db.begin_read()?;
        let blobs = txn.open_table(BLOBS)?;
        let found = blobs.get(format!("{kind}/{id}").as_str())?;
        Ok(found.map(|b| b.value().to_vec()))
    }

    /// The ids of `kind`, in id order.
    pub fn blob_ids(&self, kind: &str) -> Result<Vec<String>> {
        let txn = self.db.begin_read()?;
        let blobs = txn.open_table(BLOBS)?;
        let (from, to) = (format!("{kind}/"), format!("{kind}0"));
        let mut ids = Vec::new();
        for entry in blobs.range(from.as_str()..to.as_str())? {
            let (k, _) = entry?;
            ids.push(k.value()[from.len()..].to_string());
        }
        Ok(ids)
    }

    /// Several requests at once (`None` for unknown ids).
    pub fn get_many(&self, ids: &[String]) -> Result<Vec<Option<Job>>> {
        let txn = self.db.begin_read()?;
        let jobs = txn.open_table(JOBS)?;
        ids.iter()
            .map(|id| {
                jobs.get(id.as_str())?
                    .map(|j| decode(j.value()))
                    .transpose()
            })
            .collect()
    }

    pub fn get(&self, id: &str) -> Result<Option<Job>> {
        let txn = self.db.begin_read()?;
        let jobs = txn.open_table(JOBS)?;
        let job = jobs.get(id)?.map(|j| decode(j.value())).transpose()?;
        Ok(job)
    }

    /// Takes up to `n` queued requests in queue order and leases them.
    pub fn lease(&self, n: usize, now_ms: u64) -> Result<Vec<Job>> {
        if n == 0 {
            return Ok(Vec::new());
        }
        let lease_until = now_ms + self.config.max_idle.as_millis() as u64;
        let txn = self.db.begin_write()?;
        let mut leased = Vec::new();
        {
            let mut jobs = txn.open_table(JOBS)?;
            let mut leases = txn.open_table(LEASES)?;
            while leased.len() < n {
                let next_up = txn
                    .open_table(ORDER)?
                    .first()?
                    .map(|(k, id)| (k.value(), id.value().to_string()));
                let Some((key, id)) = next_up else {
                    break;
                };
                let Some(mut job) = jobs
                    .get(id.as_str())?
                    .map(|j| decode(j.value()))
                    .transpose()?
                else {
                    txn.open_table(ORDER)?.remove(key)?;
                    continue;
                };
                take_queued(&txn, &job)?;
                job.status = Status::Dispatched;
                job.attempts += 1;
                job.updated_ms = now_ms;
                jobs.insert(id.as_str(), encode(&job).as_slice())?;
                leases.insert(id.as_str(), lease_until)?;
                leased.push(job);
            }
        }
        txn.commit()?;
        Ok(leased)
    }

    /// Records the fleet's answer to a leased request: `succeeded` for a
    /// 2xx, `failed` otherwise. `None` if the request is no longer leased
    /// (cancelled, or its lease ran out and it was delivered again).
    pub fn finish(
        &self,
        id: &str,
        attempt: u32,
        answer: Answer,
        now_ms: u64,
    ) -> Result<Option<Job>> {
        self.end_lease(id, attempt, now_ms, |job| {
            job.status = answer.outcome();
            job.answer = Some(answer);
        })
    }

    /// A delivery failed on the way (the fleet unreachable, a 5xx): queue
    /// the request again at its place, or dead-letter it after
    /// `max_delivery` deliveries. With `counted` false (the fleet had no
    /// room: 429, 503, 504 from the balancer) the delivery does not count.
    pub fn retry(
        &self,
        id: &str,
        attempt: u32,
        error: &str,
        counted: bool,
        now_ms: u64,
    ) -> Result<Option<Job>> {
        let txn = self.db.begin_write()?;
        let job = {
            let mut jobs = txn.open_table(JOBS)?;
            let mut leases = txn.open_table(LEASES)?;
            let Some(mut job) = jobs.get(id)?.map(|j| decode(j.value())).transpose()? else {
                return Ok(None);
            };
            if job.status != Status::Dispatched || job.attempts != attempt {
                return Ok(None);
            }
            leases.remove(id)?;
            let next = self.config.redelivery(&mut job, error, counted, now_ms);
            self.redeliver(&txn, &mut job, next)?;
            jobs.insert(id, encode(&job).as_slice())?;
            job
        };
        txn.commit()?;
        Ok(Some(job))
    }

    /// Cancels a request not yet finished.
    pub fn cancel(&self, id: &str, now_ms: u64) -> Result<Option<Job>> {
        let txn = self.db.begin_write()?;
        let job = {
            let mut jobs = txn.open_table(JOBS)?;
            let Some(mut job) = jobs.get(id)?.map(|j| decode(j.value())).transpose()? else {
                return Ok(None);
            };
            if job.status.is_final() {
                return Ok(Some(job));
            }
            take_queued(&txn, &job)?;
            txn.open_table(LEASES)?.remove(id)?;
            job.status = Status::Cancelled;
            job.updated_ms = now_ms;
            mark_finished(&txn, id)?;
            jobs.insert(id, encode(&job).as_slice())?;
            job
        };
        txn.commit()?;
        Ok(Some(job))
    }

    /// Delivers again the requests whose lease ran out, expires queued ones
    /// past their deadline, and purges finished ones past retention.
    pub fn reclaim(&self, now_ms: u64) -> Result<Reclaimed> {
        let mut done = Reclaimed::default();
        let txn = self.db.begin_write()?;
        {
            let mut jobs = txn.open_table(JOBS)?;
            let mut leases = txn.open_table(LEASES)?;
            let expired_leases: Vec<String> = leases
                .iter()?
                .filter_map(|e| e.ok())
                .filter(|(_, until)| until.value() <= now_ms)
                .map(|(id, _)| id.value().to_string())
                .collect();
            for id in expired_leases {
                leases.remove(id.as_str())?;
                let Some(mut job) = jobs
                    .get(id.as_str())?
                    .map(|j| decode(j.value()))
                    .transpose()?
                else {
                    continue;
                };
                let next = self.config.redelivery(&mut job, LEASE_LOST, true, now_ms);
                self.redeliver(&txn, &mut job, next)?;
                done.record(&job);
                jobs.insert(id.as_str(), encode(&job).as_slice())?;
            }

            let mut deadlines = txn.open_table(DEADLINES)?;
            let due: Vec<((u64, u64), String)> = deadlines
                .range((0, 0)..=(now_ms, u64::MAX))?
                .filter_map(|e| e.ok())
                .map(|(k, id)| (k.value(), id.value().to_string()))
                .collect();
            for (key, id) in due {
                deadlines.remove(key)?;
                let Some(mut job) = jobs
                    .get(id.as_str())?
                    .map(|j| decode(j.value()))
                    .transpose()?
                else {
                    continue;
                };
                // Only a request still queued expires; one under way gets
                // its answer (and expires if it is ever queued again).
                if job.status == Status::Queued && job.seq == key.1 {
                    take_queued(&txn, &job)?;
                    job.status = Status::Expired;
                    job.updated_ms = now_ms;
                    mark_finished(&txn, &id)?;
                    jobs.insert(id.as_str(), encode(&job).as_slice())?;
                    done.expired.push(id);
                }
            }

            let horizon = now_ms.saturating_sub(self.config.retention.as_millis() as u64);
            let mut finished = txn.open_table(FINISHED)?;
            let mut keys = txn.open_table(KEYS)?;
            loop {
                let Some((n, id)) = finished
                    .first()?
                    .map(|(n, id)| (n.value(), id.value().to_string()))
                else {
                    break;
                };
                let job = jobs
                    .get(id.as_str())?
                    .map(|j| decode(j.value()))
                    .transpose()?;
                if job.as_ref().is_some_and(|j| j.updated_ms > horizon) {
                    break;
                }
                finished.remove(n)?;
                if let Some(job) = job {
                    jobs.remove(id.as_str())?;
                    if let Some(k) = &job.idempotency_key {
                        keys.remove(k.as_str())?;
                    }
                }
                done.purged += 1;
            }
        }
        txn.commit()?;
        Ok(done)
    }

    /// Finished requests in the order they finished, after the position
    /// `after` (`None`: from the oldest kept), at most `limit`, each with its
    /// position.
    pub fn finished_since(&self, after: Option<&str>, limit: usize) -> Result<Vec<(String, Job)>> {
        let after = after
            .map(|a| a.parse::<u64>().map_err(|_| StoreError::BadCursor))
            .transpose()?;
        let txn = self.db.begin_read()?;
        let finished = txn.open_table(FINISHED)?;
        let jobs = txn.open_table(JOBS)?;
        let start = after.map_or(0, |a| a.saturating_add(1));
        let mut out = Vec::new();
        for entry in finished.range(start..)? {
            if out.len() >= limit {
                break;
            }
            let (n, id) = entry?;
            if let Some(job) = jobs
                .get(id.value())?
                .map(|j| decode(j.value()))
                .transpose()?
            {
                out.push((n.value().to_string(), job));
            }
        }
        Ok(out)
    }

    pub fn counts(&self) -> Result<Counts> {
        let txn = self.db.begin_read()?;
        let queue = txn.open_table(QUEUE)?;
        let leases = txn.open_table(LEASES)?;
        let jobs = txn.open_table(JOBS)?;
        let oldest_queued_ms = match queue.first()? {
            Some((_, id)) => jobs
                .get(id.value())?
                .map(|j| decode(j.value()))
                .transpose()?
                .map(|j| j.created_ms),
            None => None,
        };
        Ok(Counts {
            queued: queue.len()?,
            dispatched: leases.len()?,
            finished: txn.open_table(FINISHED)?.len()?,
            oldest_queued_ms,
        })
    }

    /// Carries out [`QueueConfig::redelivery`]'s decision.
    fn redeliver(
        &self,
        txn: &redb::WriteTransaction,
        job: &mut Job,
        next: Redelivery,
    ) -> Result<()> {
        match next {
            Redelivery::Finished => mark_finished(txn, &job.id),
            Redelivery::Again => put_queued(txn, job),
            Redelivery::Rear => {
                job.seq = next_number(txn, "next_seq")?;
                if let Some(deadline) = job.deadline_ms {
                    txn.open_table(DEADLINES)?
                        .insert((deadline, job.seq), job.id.as_str())?;
                }
                put_queued(txn, job)
            }
        }
    }

    /// Ends a lease with `update` if `attempt` still holds it.
    fn end_lease(
        &self,
        id: &str,
        attempt: u32,
        now_ms: u64,
        update: impl FnOnce(&mut Job),
    ) -> Result<Option<Job>> {
        let txn = self.db.begin_write()?;
        let job = {
            let mut jobs = txn.open_table(JOBS)?;
            let Some(mut job) = jobs.get(id)?.map(|j| decode(j.value())).transpose()? else {
                return Ok(None);
            };
            if job.status != Status::Dispatched || job.attempts != attempt {
                return Ok(None);
            }
            txn.open_table(LEASES)?.remove(id)?;
            update(&mut job);
            job.updated_ms = now_ms;
            mark_finished(&txn, id)?;
            jobs.insert(id, encode(&job).as_slice())?;
            job
        };
        txn.commit()?;
        Ok(Some(job))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Dir(std::path::PathBuf);
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn dir(name: &str) -> Dir {
        Dir(std::env::temp_dir().join(format!("flowgate-store-{}-{name}", std::process::id())))
    }

    fn new_job(body: &str) -> NewJob {
        NewJob {
            path: "/v1/chat/completions".into(),
            body: body.into(),
            fairness_id: "t".into(),
            ..NewJob::default()
        }
    }

    /// The ids `store.lease(n, now_ms)` hands out, in order.
    fn leased_ids(store: &Store, n: usize, now_ms: u64) -> Vec<String> {
        let leased = store.lease(n, now_ms).unwrap();
        leased.into_iter().map(|j| j.id).collect()
    }

    fn ok(status: u16) -> Answer {
        Answer {
            status,
            body: "{}".into(),
        }
    }

    #[test]
    fn requests_survive_a_reopen_and_come_out_in_order() {
        let d = dir("reopen");
        {
            let store = Store::open(&d.0, QueueConfig::default()).unwrap();
            for i in 0..3 {
                store
                    .submit(new_job(&format!("{i}")), format!("id{i}"), 1)
                    .unwrap();
            }
            let leased = store.lease(1, 2).unwrap();
            assert_eq!(leased[0].id, "id0");
            assert_eq!(leased[0].status, Status::Dispatched);
        }
        let store = Store::open(&d.0, QueueConfig::default()).unwrap();
        let c = store.counts().unwrap();
        assert_eq!((c.queued, c.dispatched), (2, 1));
        assert_eq!(c.oldest_queued_ms, Some(1));
        let ids = leased_ids(&store, 5, 3);
        assert_eq!(ids, ["id1", "id2"]);
        let done = store.finish("id1", 1, ok(200), 4).unwrap().unwrap();
        assert_eq!(done.status, Status::Succeeded);
        assert_eq!(store.get("id1").unwrap().unwrap().answer, Some(ok(200)));
        assert_eq!(
            store.finish("id2", 1, ok(400), 4).unwrap().unwrap().status,
            Status::Failed
        );
    }

    #[test]
    fn an_idempotency_key_gives_the_same_request() {
        let d = dir("idem");
        let store = Store::open(&d.0, QueueConfig::default()).unwrap();
        let mut job = new_job("a");
        job.idempotency_key = Some("k".into());
        let (first, created) = store.submit(job.clone(), "id1".into(), 1).unwrap();
        assert!(created);
        let (again, created) = store.submit(job, "id2".into(), 2).unwrap();
        assert!(!created);
        assert_eq!(again.id, first.id);
        assert_eq!(store.counts().unwrap().queued, 1);
    }

    #[test]
    fn limits_refuse_or_evict() {
        let d = dir("limits");
        let config = QueueConfig {
            max_length: 2,
            max_payload_bytes: 4,
            ..QueueConfig::default()
        };
        let store = Store::open(&d.0, config.clone()).unwrap();
        assert!(matches!(
            store.submit(new_job("12345"), "big".into(), 1),
            Err(StoreError::TooLarge(4))
        ));
        store.submit(new_job("a"), "a".into(), 1).unwrap();
        store.submit(new_job("b"), "b".into(), 1).unwrap();
        assert!(matches!(
            store.submit(new_job("c"), "c".into(), 1),
            Err(StoreError::Full(2))
        ));
        drop(store);
        let store = Store::open(
            &d.0,
            QueueConfig {
                auto_evict: true,
                ..config
            },
        )
        .unwrap();
        store.submit(new_job("c"), "c".into(), 2).unwrap();
        assert_eq!(store.get("a").unwrap().unwrap().status, Status::Evicted);
        let ids = leased_ids(&store, 5, 3);
        assert_eq!(ids, ["b", "c"]);
    }

    #[test]
    fn lost_leases_are_delivered_again_then_dead_lettered() {
        let d = dir("lease");
        let config = QueueConfig {
            max_delivery: 2,
            max_idle: Duration::from_millis(100),
            ..QueueConfig::default()
        };
        let store = Store::open(&d.0, config.clone()).unwrap();
        store.submit(new_job("a"), "a".into(), 0).unwrap();
        store.lease(1, 0).unwrap();
        assert_eq!(
            store.reclaim(99).unwrap(),
            Reclaimed::default(),
            "lease still held"
        );
        let r = store.reclaim(100).unwrap();
        assert_eq!(r.redelivered, ["a"]);
        // The late answer of the lost delivery is ignored.
        assert_eq!(store.finish("a", 1, ok(200), 101).unwrap(), None);
        let again = store.lease(1, 200).unwrap();
        assert_eq!(again[0].attempts, 2);
        let r = store.reclaim(300).unwrap();
        assert_eq!(r.dead_lettered, ["a"]);
        assert_eq!(
            store.get("a").unwrap().unwrap().status,
            Status::DeadLettered
        );

        // `rear`: back at the end with a fresh count.
        let d2 = dir("rear");
        let rear = Store::open(
            &d2.0,
            QueueConfig {
                dead_letter: DeadLetter::Rear,
                ..config
            },
        )
        .unwrap();
        rear.submit(new_job("x"), "x".into(), 0).unwrap();
        rear.submit(new_job("y"), "y".into(), 0).unwrap();
        let x = rear.lease(1, 0).unwrap();
        rear.retry("x", x[0].attempts, "500", true, 1).unwrap();
        let x = rear.lease(1, 2).unwrap();
        assert_eq!(x[0].id, "x", "a retry keeps its place");
        let uncounted = rear.retry("x", 2, "429", false, 3).unwrap().unwrap();
        assert_eq!(uncounted.attempts, 1, "no room is not a failed delivery");
        let x = rear.lease(1, 3).unwrap();
        let after = rear
            .retry("x", x[0].attempts, "500", true, 3)
            .unwrap()
            .unwrap();
        assert_eq!((after.status, after.attempts), (Status::Queued, 0));
        let ids = leased_ids(&rear, 5, 4);
        assert_eq!(ids, ["y", "x"], "dead-lettered to the rear");
    }

    #[test]
    fn cancel_expiry_and_retention() {
        let d = dir("ends");
        let config = QueueConfig {
            retention: Duration::from_millis(1000),
            ..QueueConfig::default()
        };
        let store = Store::open(&d.0, config).unwrap();
        store.submit(new_job("a"), "a".into(), 0).unwrap();
        let mut late = new_job("b");
        late.deadline_ms = Some(50);
        late.idempotency_key = Some("kb".into());
        store.submit(late, "b".into(), 0).unwrap();
        assert_eq!(
            store.cancel("a", 10).unwrap().unwrap().status,
            Status::Cancelled
        );
        assert_eq!(store.reclaim(50).unwrap().expired, ["b"]);
        assert_eq!(store.get("b").unwrap().unwrap().status, Status::Expired);
        assert!(store.lease(5, 60).unwrap().is_empty());
        assert_eq!(store.reclaim(1000).unwrap().purged, 0);
        assert_eq!(store.reclaim(1049).unwrap().purged, 1, "a, finished at 10");
        assert_eq!(store.get("b").unwrap().unwrap().status, Status::Expired);
        assert_eq!(store.reclaim(1051).unwrap().purged, 1, "b, finished at 50");
        assert_eq!(store.get("a").unwrap(), None);
        // The key is free again.
        let mut again = new_job("b");
        again.idempotency_key = Some("kb".into());
        assert!(store.submit(again, "b2".into(), 1100).unwrap().1);
    }

    #[test]
    fn higher_priority_requests_are_leased_first() {
        let d = dir("priority");
        let store = Store::open(&d.0, QueueConfig::default()).unwrap();
        for (id, priority) in [("low", -5), ("first", 0), ("high", 10), ("second", 0)] {
            let job = NewJob {
                priority,
                ..new_job(id)
            };
            store.submit(job, id.into(), 0).unwrap();
        }
        let order = leased_ids(&store, 4, 1);
        assert_eq!(order, ["high", "first", "second", "low"]);
        // A retried request keeps its place among its priority.
        store.retry("first", 1, "500", true, 2).unwrap();
        store
            .submit(
                NewJob {
                    priority: 0,
                    ..new_job("third")
                },
                "third".into(),
                3,
            )
            .unwrap();
        let order = leased_ids(&store, 4, 4);
        assert_eq!(order, ["first", "third"]);
    }

    #[test]
    fn the_results_feed_lists_finished_requests_in_finish_order() {
        let d = dir("feed");
        let store = Store::open(&d.0, QueueConfig::default()).unwrap();
        for id in ["a", "b", "c"] {
            store.submit(new_job(id), id.into(), 0).unwrap();
        }
        store.lease(3, 1).unwrap();
        store.finish("c", 1, ok(200), 2).unwrap();
        store.finish("a", 1, ok(200), 2).unwrap();
        let feed = store.finished_since(None, 10).unwrap();
        let ids: Vec<_> = feed.iter().map(|(_, j)| j.id.as_str()).collect();
        assert_eq!(ids, ["c", "a"], "finish order, not id or time order");
        let cursor = feed[1].0.clone();
        assert!(store.finished_since(Some(&cursor), 10).unwrap().is_empty());
        store.finish("b", 1, ok(500), 3).unwrap();
        let more = store.finished_since(Some(&cursor), 10).unwrap();
        assert_eq!(more.len(), 1);
        assert_eq!(
            (more[0].1.id.as_str(), more[0].1.status),
            ("b", Status::Failed)
        );
        assert_eq!(store.finished_since(None, 1).unwrap().len(), 1, "limit");
        assert!(matches!(
            store.finished_since(Some("x"), 1),
            Err(StoreError::BadCursor)
        ));
    }

    #[test]
    fn a_request_queued_again_after_its_deadline_expires() {
        let d = dir("deadline-retry");
        let store = Store::open(&d.0, QueueConfig::default()).unwrap();
        let mut job = new_job("a");
        job.deadline_ms = Some(100);
        store.submit(job, "a".into(), 0).unwrap();
        store.lease(1, 10).unwrap();
        // The deadline passes while it is under way: no expiry then.
        assert!(store.reclaim(150).unwrap().expired.is_empty());
        let retried = store.retry("a", 1, "500", true, 160).unwrap().unwrap();
        assert_eq!(retried.status, Status::Expired);
        assert!(store.lease(1, 170).unwrap().is_empty());
    }
}
