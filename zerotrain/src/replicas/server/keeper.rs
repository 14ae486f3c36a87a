//! A server's keeper, beside its gRPC service: every tick it drops the groups that keep the
//! others waiting past the group timeout and starts a due checkpoint's save; a round counts
//! as saved only once written, a failed save is tried again, and a stop waits for the save
//! in flight before saving what is newer.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::place::Place;
use super::service::{Service, State};
use super::store;
use crate::config::ReplicaMode;

/// How long the keeper waits before trying a failed save again.
const RETRY_SAVE: Duration = Duration::from_secs(2);

impl Service {
    /// Drops the groups past the timeout and starts a due checkpoint's save, every tenth of
    /// the timeout (at most every 200 ms), until the server stops. A save runs beside the
    /// keeper (which goes on dropping groups meanwhile); a failed one is tried again.
    pub async fn keep(self) {
        let tick = (self.config.group_timeout / 10).min(Duration::from_millis(200));
        // Async places count pushes: a round is every group's.
        let every = match self.config.mode {
            ReplicaMode::Sync => self.config.checkpoint_every,
            ReplicaMode::Async { .. } => self.config.checkpoint_every * self.config.groups as u64,
        };
        loop {
            tokio::time::sleep(tick).await;
            let due = {
                let mut state = self.lock();
                let now = Instant::now();
                let mut changed = false;
                for (p, place) in state.places.iter_mut().enumerate() {
                    let Some(place) = place else { continue };
                    for g in place.expire(now, self.config.group_timeout, &self.config.outer) {
                        eprintln!(
                            "zerotrain serve: place {p} dropped group {g}: it kept the others waiting over {:.1} s \
                             (local_sgd.group_timeout_s); {} groups live",
                            self.config.group_timeout.as_secs_f64(),
                            place.live()
                        );
                        changed = true;
                    }
                }
                if changed {
                    self.changed();
                }
                let retry_later = state.failed.as_ref().is_some_and(|(_, at)| now < *at);
                if retry_later || !self.write_finished() { None } else { self.due_checkpoint(&state, every) }
            };
            if let Some((places, round)) = due {
                let service = self.clone();
                let task = tokio::spawn(async move { drop(service.save(places, round).await) });
                *self.writing.lock().unwrap_or_else(|e| e.into_inner()) = Some(task);
            }
        }
    }

    /// Whether no save of the keeper's is running.
    fn write_finished(&self) -> bool {
        self.writing.lock().unwrap_or_else(|e| e.into_inner()).as_ref().is_none_or(|task| task.is_finished())
    }

    /// Saves `places` at `round` on a blocking thread and says so; the round counts as saved
    /// only once written. A failure is kept (the keeper tries again after [`RETRY_SAVE`])
    /// and returned.
    async fn save(&self, places: Vec<Option<Place>>, round: u64) -> std::result::Result<(), String> {
        let Some(dir) = self.config.checkpoint.clone() else { return Ok(()) };
        let config = Arc::clone(&self.config);
        let saved = tokio::task::spawn_blocking(move || store::save(&dir, &config, &places, round)).await;
        let outcome = match saved {
            Ok(Ok(path)) => Ok(path),
            Ok(Err(e)) => Err(format!("the checkpoint of round {round} failed: {e}")),
            Err(e) => Err(format!("the checkpoint of round {round}: its writer failed: {e}")),
        };
        let mut state = self.lock();
        match outcome {
            Ok(path) => {
                eprintln!("zerotrain serve: saved {}", path.display());
                state.saved = state.saved.max(round);
                state.failed = None;
                Ok(())
            }
            Err(e) => {
                eprintln!("zerotrain serve: {e} (trying again in {} s)", RETRY_SAVE.as_secs());
                state.failed = Some((e.clone(), Instant::now() + RETRY_SAVE));
                Err(e)
            }
        }
    }

    /// At a stop: waits for the keeper's save in flight, then saves what the last
    /// checkpoint does not have yet (with a folder). An error says which round is not on
    /// disk and why.
    pub async fn save_last(&self) -> std::result::Result<(), String> {
        let running = self.writing.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(task) = running {
            let _ = task.await;
        }
        let last = self.due_checkpoint(&self.lock(), 1);
        match last {
            Some((places, round)) => self.save(places, round).await,
            None => Ok(()),
        }
    }

    /// A snapshot of the places to save, and their round, once every place is `every`
    /// rounds past the last checkpoint written (with a folder).
    fn due_checkpoint(&self, state: &State, every: u64) -> Option<(Vec<Option<Place>>, u64)> {
        self.config.checkpoint.as_ref()?;
        let round = state.places.iter().flatten().map(|p| p.round).min()?;
        if round < state.saved.saturating_add(every) {
            return None;
        }
        Some((state.places.iter().map(|p| p.as_ref().map(Place::snapshot)).collect(), round))
    }
}
