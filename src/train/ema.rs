//! A running estimate of throughput (samples per second), sans-IO: hivemind's
//! `PerformanceEMA` with the clock passed in.
//!
//! The estimate is an exponential moving average of *seconds per sample* with smoothing factor
//! `alpha`, bias-corrected for the number of updates (`ema / (1 - (1 - alpha)^n)`, so the first
//! update is not pulled toward the initial 0), and reported inverted, at most `1 / eps`.
//! Before any update the rate is `eps`. While paused, time passing does not count: an update
//! must then say how long its task took.

/// Why an update was refused.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum EmaError {
    /// The task size is not a finite positive number.
    #[error("cannot register a task of {0} samples")]
    BadTaskSize(f64),
    /// The interval is not a finite non-negative number.
    #[error("interval {0} is not a finite non-negative number of seconds")]
    BadInterval(f64),
    /// Paused, and no interval given.
    #[error("the estimate is paused: give the task's interval")]
    PausedWithoutInterval,
}

/// Throughput estimate: an exponential moving average of seconds per sample, bias-corrected
/// for the number of updates, reported inverted (at most `1 / eps`); `eps` before any update.
/// While paused, time passing does not count and an update must give its interval.
#[derive(Clone, Debug, PartialEq)]
pub struct PerformanceEma {
    alpha: f64,
    eps: f64,
    num_updates: u32,
    ema_seconds_per_sample: f64,
    samples_per_second: f64,
    /// When the last task ended (or the timer was reset).
    timestamp: f64,
    paused: bool,
}

impl PerformanceEma {
    /// A fresh estimate (`eps` samples per second) whose timer starts at `now` (seconds).
    /// `alpha` is clamped to `(0, 1]` and `eps` to a positive value.
    pub fn new(alpha: f64, eps: f64, now: f64) -> Self {
        let alpha = if alpha.is_finite() {
            alpha.clamp(f64::MIN_POSITIVE, 1.0)
        } else {
            1.0
        };
        let eps = if eps.is_finite() && eps > 0.0 {
            eps
        } else {
            1e-20
        };
        Self {
            alpha,
            eps,
            num_updates: 0,
            ema_seconds_per_sample: 0.0,
            samples_per_second: eps,
            timestamp: now,
            paused: false,
        }
    }

    /// The current estimate (samples per second).
    pub fn samples_per_second(&self) -> f64 {
        self.samples_per_second
    }

    /// The floor of the estimate (and its value before any update).
    pub fn eps(&self) -> f64 {
        self.eps
    }

    /// Updates made so far.
    pub fn num_updates(&self) -> u32 {
        self.num_updates
    }

    /// Whether time passing is ignored.
    pub fn is_paused(&self) -> bool {
        self.paused
    }

    /// Registers `task_size` samples processed in `interval` seconds, or, without an interval,
    /// since the last update or timer reset (then the timer restarts at `now`). Returns the new
    /// estimate.
    pub fn update(
        &mut self,
        task_size: f64,
        interval: Option<f64>,
        now: f64,
    ) -> Result<f64, EmaError> {
        if !(task_size.is_finite() && task_size > 0.0) {
            return Err(EmaError::BadTaskSize(task_size));
        }
        let interval = match interval {
            Some(i) if !(i.is_finite() && i >= 0.0) => return Err(EmaError::BadInterval(i)),
            Some(i) => {
                if !self.paused {
                    self.timestamp = now;
                }
                i
            }
            None if self.paused => return Err(EmaError::PausedWithoutInterval),
            None => {
                // A clock stepping back counts as no time passing.
                let i = (now - self.timestamp).max(0.0);
                self.timestamp = now;
                i
            }
        };
        self.ema_seconds_per_sample =
            self.alpha * interval / task_size + (1.0 - self.alpha) * self.ema_seconds_per_sample;
        self.num_updates = self.num_updates.saturating_add(1);
        let correction = 1.0 - (1.0 - self.alpha).powf(f64::from(self.num_updates));
        let adjusted = self.ema_seconds_per_sample / correction;
        self.samples_per_second = 1.0 / adjusted.max(self.eps);
        Ok(self.samples_per_second)
    }

    /// Restarts the timer at `now`: the next update counts from here.
    pub fn reset_timer(&mut self, now: f64) {
        self.timestamp = now;
    }

    /// Stops counting time (updates then need an interval).
    pub fn pause(&mut self) {
        self.paused = true;
    }

    /// Counts time again, from `now`.
    pub fn resume(&mut self, now: f64) {
        self.paused = false;
        self.reset_timer(now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steady_rate_is_estimated_and_pauses_do_not_count() {
        let mut ema = PerformanceEma::new(0.1, 1e-20, 0.0);
        assert_eq!(ema.samples_per_second(), 1e-20);
        let mut t = 0.0;
        for _ in 0..50 {
            t += 2.0;
            ema.update(10.0, None, t).unwrap();
        }
        assert!((ema.samples_per_second() - 5.0).abs() < 1e-9, "{ema:?}");
        // Bias correction: one update already gives the exact rate.
        let mut one = PerformanceEma::new(0.1, 1e-20, 0.0);
        assert!((one.update(30.0, None, 3.0).unwrap() - 10.0).abs() < 1e-9);

        ema.pause();
        assert_eq!(
            ema.update(1.0, None, t + 100.0),
            Err(EmaError::PausedWithoutInterval)
        );
        ema.resume(t + 1000.0);
        ema.update(10.0, None, t + 1002.0).unwrap();
        assert!(
            (ema.samples_per_second() - 5.0).abs() < 1e-9,
            "paused time counted"
        );
        assert!(ema.update(0.0, None, t).is_err());
        assert!(ema.update(f64::NAN, None, t).is_err());
        assert!(ema.update(1.0, Some(-1.0), t).is_err());
    }
}
