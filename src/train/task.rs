//! A background task owned by a handle (the progress tracker's, the metrics publisher's, the
//! monitor's): its loops watch a stop flag; stopping sets it and waits for the task at most a
//! timeout, then aborts it; dropping the owner aborts it.

use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

/// See the [module docs](self).
#[derive(Debug)]
pub(crate) struct OwnedTask {
    stop: watch::Sender<bool>,
    task: Mutex<Option<JoinHandle<()>>>,
}

impl OwnedTask {
    /// No task yet, not stopped.
    pub(crate) fn new() -> Self {
        Self {
            stop: watch::Sender::new(false),
            task: Mutex::new(None),
        }
    }

    /// Spawns `run(stop flag)` unless a task runs or the owner was stopped (call within a
    /// tokio runtime).
    pub(crate) fn spawn<F, Fut>(&self, run: F)
    where
        F: FnOnce(watch::Receiver<bool>) -> Fut,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let mut task = self.task.lock().unwrap_or_else(|e| e.into_inner());
        if task.is_some() || *self.stop.borrow() {
            return;
        }
        *task = Some(tokio::spawn(run(self.stop.subscribe())));
    }

    /// Whether the task runs.
    pub(crate) fn is_running(&self) -> bool {
        self.task
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .is_some_and(|t| !t.is_finished())
    }

    /// Sets the stop flag and waits for the task at most `timeout`, then aborts it; whether
    /// this was the first stop.
    pub(crate) async fn stop(&self, timeout: Duration) -> bool {
        let first = !self.stop.send_replace(true);
        let task = self.task.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(mut task) = task
            && tokio::time::timeout(timeout, &mut task).await.is_err()
        {
            task.abort();
        }
        first
    }
}

impl Drop for OwnedTask {
    fn drop(&mut self) {
        self.stop.send_replace(true);
        if let Some(task) = self
            .task
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            task.abort();
        }
    }
}
