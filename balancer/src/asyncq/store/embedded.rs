//! The embedded, durable store of async requests (redb: every change is one
//! ACID transaction, synced to disk before it returns, so nothing accepted is
//! lost when the process is killed). Requests are leased highest priority
//! first, first come first within a priority; a request delivered again
//! keeps its place.

use std::path::Path;

use redb::{Database, ReadableDatabase, ReadableTable, ReadableTableMetadata, TableDefinition};

use super::JobStore;
use crate::asyncq::job::{
    Answer, Counts, Job, NewJob, QueueConfig, Reclaimed, Redelivery, Result, Status, StoreError,
    LEASE_LOST,
};

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

pub struct EmbeddedStore {
    db: Database,
    config: QueueConfig,
}

impl EmbeddedStore {
    /// Opens (or creates) the store in `dir`.
    pub fn open(dir: &Path, config: QueueConfig) -> Result<EmbeddedStore> {
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
        Ok(EmbeddedStore { db, config })
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

impl JobStore for EmbeddedStore {
    /// Queues several requests in one transaction: all or none. With an
    /// idempotency key already seen, a request is the one that key made
    /// (`false`: nothing new was queued).
    fn submit_many(&self, new: Vec<(NewJob, String)>, now_ms: u64) -> Result<Vec<(Job, bool)>> {
        self.config.check_payloads(&new)?;
        let txn = self.db.begin_write()?;
        let mut out = Vec::with_capacity(new.len());
        for (job, id) in new {
            out.push(self.insert(&txn, job, id, now_ms)?);
        }
        txn.commit()?;
        Ok(out)
    }

    /// Stores `bytes` as `id` of `kind` (Batch API files and batches).
    fn put_blob(&self, kind: &str, id: &str, bytes: &[u8]) -> Result<()> {
        let txn = self.db.begin_write()?;
        txn.open_table(BLOBS)?
            .insert(format!("{kind}/{id}").as_str(), bytes)?;
        txn.commit()?;
        Ok(())
    }

    fn delete_blob(&self, kind: &str, id: &str) -> Result<()> {
        let txn = self.db.begin_write()?;
        txn.open_table(BLOBS)?
            .remove(format!("{kind}/{id}").as_str())?;
        txn.commit()?;
        Ok(())
    }

    fn get_blob(&self, kind: &str, id: &str) -> Result<Option<Vec<u8>>> {
        let txn = self.db.begin_read()?;
        let blobs = txn.open_table(BLOBS)?;
        let found = blobs.get(format!("{kind}/{id}").as_str())?;
        Ok(found.map(|b| b.value().to_vec()))
    }

    /// The ids of `kind`, in id order.
    fn blob_ids(&self, kind: &str) -> Result<Vec<String>> {
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
    fn get_many(&self, ids: &[String]) -> Result<Vec<Option<Job>>> {
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

    fn get(&self, id: &str) -> Result<Option<Job>> {
        let txn = self.db.begin_read()?;
        let jobs = txn.open_table(JOBS)?;
        let job = jobs.get(id)?.map(|j| decode(j.value())).transpose()?;
        Ok(job)
    }

    /// Takes up to `n` queued requests in queue order and leases them.
    fn lease(&self, n: usize, now_ms: u64) -> Result<Vec<Job>> {
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
    fn finish(&self, id: &str, attempt: u32, answer: Answer, now_ms: u64) -> Result<Option<Job>> {
        self.end_lease(id, attempt, now_ms, |job| {
            job.status = answer.outcome();
            job.answer = Some(answer);
        })
    }

    /// A delivery failed on the way (the fleet unreachable, a 5xx): queue
    /// the request again at its place, or dead-letter it after
    /// `max_delivery` deliveries. With `counted` false (the fleet had no
    /// room: 429, 503, 504 from the balancer) the delivery does not count.
    fn retry(
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
    fn cancel(&self, id: &str, now_ms: u64) -> Result<Option<Job>> {
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
    fn reclaim(&self, now_ms: u64) -> Result<Reclaimed> {
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
    fn finished_since(&self, after: Option<&str>, limit: usize) -> Result<Vec<(String, Job)>> {
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

    fn counts(&self) -> Result<Counts> {
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
}
