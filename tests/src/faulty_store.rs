//! [`FaultyStore`]: the memory store with faults switched on by the test, for what the
//! middleware does when a store is slow or fails one step.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use idempotency_actix::{
    BeginOutcome, Fingerprint, IdempotencyStore, LeaseToken, MemoryStore, StorageKey, StoreError,
    StoredResponse,
};

use crate::RunCounter;

/// The memory store, with faults: its `begin`s are counted in `begins` as they are sent, its
/// next `failed_begins` fail as a store that times out does, its next `unavailable_begins`
/// as a store that answers an error does and its next `refused_begins` as a full store
/// refuses a new key (`StoreError::Refused`; nothing reaches `inner` either), and each answers only after
/// `delay`, as a Redis under `DEBUG SLEEP` does; its next `landed_failed_begins` reach
/// `inner` and then fail as a store that times out does (the `begin` landed, its reply was
/// lost); its `commit` only after `commit_delay`; a
/// `begin` or `commit` that ran may answer only `begin_reply_delay` or `commit_reply_delay`
/// later (a reply stuck behind a large one), and a renewal may reach the store only
/// `renew_delay` after it was sent; its next `failed_renewals` renewals fail as a store that
/// times out does, and its next `failed_commits` commits fail as a store that refuses them
/// does (a Redis at its memory limit that still takes a small in-flight record), and the
/// next `lost_commits` of those that do not fail answer that they wrote and write nothing
/// (a primary that took them and lost them as a failover demoted it); each
/// `release` is counted in `releases` as it is sent and reaches `inner` only after
/// `release_delay`; its next `late_begins` fail as a store that times out does and reach
/// `inner` only `late_by` later, on their own, counted in `late_landed` once they did (a `begin` stuck in a connection's queue that
/// lands after its request gave it up), and so do its next `late_renewals` renewals (a
/// renewal given up by the store timeout that lands later, setting the lease it was sent
/// with); its next `lost_releases` never reach `inner` and
/// fail as a store that times out does (a process stopped before they were sent); each
/// `abandon` reaches `inner` only after `abandon_delay` and is counted in `abandons` once it
/// did. Clones share the store and the counts.
#[derive(Clone, Default)]
pub struct FaultyStore {
    /// The store behind the faults.
    pub inner: MemoryStore,
    /// The `begin`s sent, counted as they are sent.
    pub begins: RunCounter,
    /// How many `begin`s are still to fail.
    pub failed_begins: Arc<AtomicU32>,
    /// How many `begin`s are still to fail with an error of the store's
    /// (`StoreError::Unavailable`) without reaching `inner`.
    pub unavailable_begins: Arc<AtomicU32>,
    /// How many `begin`s are still to be refused as a full store refuses a new key
    /// (`StoreError::Refused`: nothing written) without reaching `inner`.
    pub refused_begins: Arc<AtomicU32>,
    /// How many `begin`s are still to land in `inner` and then fail as a timeout.
    pub landed_failed_begins: Arc<AtomicU32>,
    /// How long each `begin` waits before it reaches `inner`.
    pub delay: Duration,
    /// How long each `commit` waits before it reaches `inner`.
    pub commit_delay: Duration,
    /// How long each `begin`'s answer comes after `inner` ran it.
    pub begin_reply_delay: Duration,
    /// How long each renewal waits before it reaches `inner`.
    pub renew_delay: Duration,
    /// How long each `commit`'s answer comes after `inner` ran it.
    pub commit_reply_delay: Duration,
    /// How many renewals are still to fail.
    pub failed_renewals: Arc<AtomicU32>,
    /// How many commits are still to fail (`u32::MAX`: until the test sets it to 0).
    pub failed_commits: Arc<AtomicU32>,
    /// How many commits that do not fail are still to answer `true` without reaching
    /// `inner`.
    pub lost_commits: Arc<AtomicU32>,
    /// How long each `release` waits before it reaches `inner`.
    pub release_delay: Duration,
    /// The `release`s sent, counted as they are sent (before `release_delay`).
    pub releases: RunCounter,
    /// How many `begin`s are still to time out and land `late_by` later.
    pub late_begins: Arc<AtomicU32>,
    /// How long after it timed out a late `begin` lands in `inner`.
    pub late_by: Duration,
    /// The late `begin`s that reached `inner`, counted once they did.
    pub late_landed: RunCounter,
    /// How many renewals are still to time out and land `late_by` later.
    pub late_renewals: Arc<AtomicU32>,
    /// How many `release`s are still to be lost.
    pub lost_releases: Arc<AtomicU32>,
    /// How long each `abandon` waits before it reaches `inner`.
    pub abandon_delay: Duration,
    /// The `abandon`s that reached `inner`, counted once they did.
    pub abandons: RunCounter,
}

/// Takes one from `left` unless it is 0: whether this call is to fail.
fn fails(left: &AtomicU32) -> bool {
    left.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |left| {
        left.checked_sub(1)
    })
    .is_ok()
}

impl IdempotencyStore for FaultyStore {
    async fn begin(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        token: &LeaseToken,
        lease: Duration,
    ) -> Result<BeginOutcome, StoreError> {
        self.begins.record();
        if fails(&self.failed_begins) {
            return Err(StoreError::Timeout(Duration::from_secs(2)));
        }
        if fails(&self.unavailable_begins) {
            return Err(StoreError::Unavailable("begin failed on purpose".into()));
        }
        if fails(&self.refused_begins) {
            return Err(StoreError::Refused("full on purpose".into()));
        }
        if fails(&self.late_begins) {
            let (inner, key, fingerprint, token) =
                (self.inner.clone(), key.clone(), *fingerprint, *token);
            let (late_by, landed) = (self.late_by, self.late_landed.clone());
            actix_rt::spawn(async move {
                actix_rt::time::sleep(late_by).await;
                // What it finds is for the test to observe through the key: its outcome
                // went to no one, as a late `begin`'s reply does.
                let _outcome = inner.begin(&key, &fingerprint, &token, lease).await;
                landed.record();
            });
            return Err(StoreError::Timeout(Duration::from_secs(2)));
        }
        actix_rt::time::sleep(self.delay).await;
        let begun = self.inner.begin(key, fingerprint, token, lease).await;
        if fails(&self.landed_failed_begins) {
            return Err(StoreError::Timeout(Duration::from_secs(2)));
        }
        actix_rt::time::sleep(self.begin_reply_delay).await;
        begun
    }

    async fn renew(
        &self,
        key: &StorageKey,
        token: &LeaseToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        if fails(&self.failed_renewals) {
            return Err(StoreError::Timeout(Duration::from_secs(2)));
        }
        if fails(&self.late_renewals) {
            let (inner, key, token, late_by) =
                (self.inner.clone(), key.clone(), *token, self.late_by);
            actix_rt::spawn(async move {
                actix_rt::time::sleep(late_by).await;
                // Its answer goes to no one, as a late renewal's does.
                let _renewed = inner.renew(&key, &token, lease).await;
            });
            return Err(StoreError::Timeout(Duration::from_secs(2)));
        }
        actix_rt::time::sleep(self.renew_delay).await;
        self.inner.renew(key, token, lease).await
    }

    async fn commit(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        token: &LeaseToken,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        actix_rt::time::sleep(self.commit_delay).await;
        if fails(&self.failed_commits) {
            return Err(StoreError::Protocol("commit refused on purpose".into()));
        }
        if fails(&self.lost_commits) {
            return Ok(true);
        }
        let committed = self
            .inner
            .commit(key, fingerprint, token, response, ttl)
            .await;
        actix_rt::time::sleep(self.commit_reply_delay).await;
        committed
    }

    async fn release(&self, key: &StorageKey, token: &LeaseToken) -> Result<bool, StoreError> {
        self.releases.record();
        if fails(&self.lost_releases) {
            return Err(StoreError::Timeout(Duration::from_secs(2)));
        }
        actix_rt::time::sleep(self.release_delay).await;
        self.inner.release(key, token).await
    }

    async fn abandon(
        &self,
        key: &StorageKey,
        token: &LeaseToken,
        remember_for: Duration,
    ) -> Result<bool, StoreError> {
        actix_rt::time::sleep(self.abandon_delay).await;
        let abandoned = self.inner.abandon(key, token, remember_for).await;
        self.abandons.record();
        abandoned
    }
}
