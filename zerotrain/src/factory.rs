//! Which [`Trainer`] a plan asks for ([`trainer`]): above the engine, the pipeline and the
//! replica groups, which do not import it.

use crate::Result;
use crate::config::Plan;
use crate::context::RankContext;
use crate::engine::model::UnitModel;
use crate::engine::{Engine, Pipeline};
use crate::trainer::Trainer;

/// The trainer `plan` asks for: a [`Pipeline`] stage under a `pipeline` section, replica
/// groups ([`LocalSgd`](crate::replicas::LocalSgd)) under a `local_sgd` section, else an
/// [`Engine`] over the model's declared units.
pub fn trainer<M: UnitModel + 'static>(model: M, plan: &Plan, ctx: &RankContext) -> Result<Box<dyn Trainer<M>>> {
    if plan.replicas.is_some() {
        let (group_ctx, group_plan, replicas) = crate::replicas::split(ctx, plan)?;
        let engine = Engine::with_units(model, &group_plan, &group_ctx)?;
        return Ok(Box::new(crate::replicas::LocalSgd::new(engine, replicas)?));
    }
    Ok(match plan.pipeline {
        Some(_) => Box::new(Pipeline::new(model, plan, ctx)?),
        None => Box::new(Engine::with_units(model, plan, ctx)?),
    })
}
