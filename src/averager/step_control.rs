//! A scheduled step's handle ([`StepControl`]): its stage, trigger, cancellation, result, and
//! the parameters its owner may still change until the all-reduce begins.
//!
//! # Late parameters
//!
//! hivemind's `GradientAverager` schedules a step early (to find a group while gradients are
//! still being accumulated) and sets its weight only when it knows how many samples it holds;
//! a peer that loads a state instead of training tags along at weight 0. So the weight and the
//! scheduled time live in a cell ([`StepParams`]) that the [`StepControl`] and the averager's
//! actor share. The actor reads the scheduled time each time it (re)starts matchmaking and
//! whenever the cell changes (the next declaration uses it), and reads the weight, marking the
//! cell as begun in the same critical section, the moment the all-reduce begins. A change
//! after that is refused with [`StepControlError::TooLate`]: the value in the cell is the
//! one the round used, never a later one.

use tokio::sync::{oneshot, watch};

use super::{AveragerError, StepOutcome};
use crate::dht::DhtTime;

/// Where a step is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// Queued behind another step.
    Queued,
    /// Looking for a group.
    Matchmaking,
    /// Group assembled; waiting for [`StepControl::trigger`].
    AwaitingTrigger,
    /// Linking to the group and running the all-reduce.
    AllReduce,
    /// Done (successfully or not).
    Finished,
}

/// What a step's owner may change until its all-reduce begins (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct StepParams {
    /// This peer's averaging weight.
    pub(super) weight: f64,
    /// When the all-reduce should begin at the earliest (`None`: as soon as matchmaking's
    /// minimum time allows).
    pub(super) scheduled_time: Option<DhtTime>,
    /// Set (with the weight read) when the all-reduce begins; no change is taken after.
    pub(super) began: bool,
}

impl StepParams {
    /// The parameters `options` start a step with.
    pub(super) fn of(options: &super::StepOptions) -> Self {
        Self {
            weight: options.weight,
            scheduled_time: options
                .scheduled_in
                .map(|d| DhtTime::now().saturating_add(d)),
            began: false,
        }
    }
}

/// Why a step's parameter was not changed.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum StepControlError {
    /// The all-reduce has begun (or the step has finished): it uses the value it read then.
    #[error("the step's all-reduce has already begun; the change has no effect")]
    TooLate,
    /// A weight must be 0 or a normal number up to [`crate::allreduce::MAX_WEIGHT`].
    #[error(
        "weight {0} is not 0 or a finite positive number up to {max:e}",
        max = crate::allreduce::MAX_WEIGHT
    )]
    InvalidWeight(f64),
}

/// Whether `weight` may be a step's weight (what the all-reduce accepts).
pub(super) fn check_weight(weight: f64) -> Result<(), StepControlError> {
    if crate::allreduce::valid_weight(weight) {
        Ok(())
    } else {
        Err(StepControlError::InvalidWeight(weight))
    }
}

/// A scheduled step: trigger it, cancel it, watch its stage, change its weight or scheduled
/// time until the all-reduce begins, await its result.
#[derive(Debug)]
pub struct StepControl {
    pub(super) stage: watch::Receiver<Stage>,
    pub(super) trigger: watch::Sender<bool>,
    pub(super) cancel: watch::Sender<bool>,
    pub(super) params: watch::Sender<StepParams>,
    pub(super) result: oneshot::Receiver<Result<StepOutcome, AveragerError>>,
}

impl StepControl {
    /// Allows the all-reduce to begin once the group is assembled.
    pub fn trigger(&self) {
        let _ = self.trigger.send(true);
    }

    /// Cancels the step in whatever stage it is (see the module docs of
    /// [`crate::averager`]).
    pub fn cancel(&self) {
        let _ = self.cancel.send(true);
    }

    /// The current stage.
    pub fn stage(&self) -> Stage {
        *self.stage.borrow()
    }

    /// Waits until the stage is `stage` or later.
    pub async fn reached(&mut self, stage: Stage) {
        let order = |s: Stage| s as u8;
        let _ = self.stage.wait_for(|s| order(*s) >= order(stage)).await;
    }

    /// The weight the step has (the one its all-reduce used, once it began).
    pub fn weight(&self) -> f64 {
        self.params.borrow().weight
    }

    /// Sets this peer's weight for the step's all-reduce. Taken until the all-reduce begins;
    /// afterwards [`StepControlError::TooLate`] and nothing changes.
    pub fn set_weight(&self, weight: f64) -> Result<(), StepControlError> {
        check_weight(weight)?;
        self.modify(|p| p.weight = weight)
    }

    /// When the all-reduce should begin at the earliest (`None`: as soon as matchmaking's
    /// minimum time allows).
    pub fn scheduled_time(&self) -> Option<DhtTime> {
        self.params.borrow().scheduled_time
    }

    /// Sets when the all-reduce should begin at the earliest (hivemind's `scheduled_time`):
    /// matchmaking declares this peer until then, from its next declaration on (one made
    /// before the change stands until it expires). Taken until the all-reduce begins;
    /// afterwards [`StepControlError::TooLate`].
    pub fn set_scheduled_time(&self, at: DhtTime) -> Result<(), StepControlError> {
        self.modify(|p| p.scheduled_time = Some(at))
    }

    /// Whether the setters still take changes: `false` once the all-reduce has begun (or the
    /// step ended before it), when the weight and scheduled time are final.
    pub fn accepts_changes(&self) -> bool {
        !self.params.borrow().began
    }

    fn modify(&self, change: impl FnOnce(&mut StepParams)) -> Result<(), StepControlError> {
        let mut refused = false;
        self.params.send_if_modified(|p| {
            if p.began {
                refused = true;
                return false;
            }
            change(p);
            true
        });
        if refused {
            Err(StepControlError::TooLate)
        } else {
            Ok(())
        }
    }

    /// The step's result.
    pub async fn result(self) -> Result<StepOutcome, AveragerError> {
        self.result.await.unwrap_or(Err(AveragerError::Shutdown))
    }

    /// Separates the result from the controls: the returned future resolves to the step's
    /// result, while [`StepControl::trigger`], [`StepControl::cancel`], the setters and the
    /// stage keep working on `self` (so another thread can cancel while one awaits the
    /// result). Called twice, the second future says [`AveragerError::Shutdown`], as does
    /// [`StepControl::result`] afterwards.
    pub fn take_result(
        &mut self,
    ) -> impl std::future::Future<Output = Result<StepOutcome, AveragerError>> + Send + 'static
    {
        let (_, closed) = oneshot::channel();
        let result = std::mem::replace(&mut self.result, closed);
        async move { result.await.unwrap_or(Err(AveragerError::Shutdown)) }
    }
}

/// The actor's side of a step's parameters.
pub(super) struct ParamsCell(pub(super) watch::Sender<StepParams>);

impl ParamsCell {
    /// Marks the all-reduce as begun and returns the weight it uses (read in the same
    /// critical section, so no later change can slip in).
    pub(super) fn begin(&self) -> f64 {
        let mut weight = 0.0;
        self.0.send_modify(|p| {
            p.began = true;
            weight = p.weight;
        });
        weight
    }

    /// Marks the step as past changes (it finished or failed before its all-reduce).
    pub(super) fn close(&self) {
        self.0
            .send_if_modified(|p| !std::mem::replace(&mut p.began, true));
    }

    /// The scheduled time now.
    pub(super) fn scheduled_time(&self) -> Option<DhtTime> {
        self.0.borrow().scheduled_time
    }
}
