// expect: compiles
// Positive control: correct uses of the templates the cf_*.cpp files misuse, built by the
// same harness, so a broken harness (or a broken header) fails here rather than letting
// every cf_ test pass on the wrong error. Compiled, never run.
#include <lockstep/comm/thread_comm.hpp>
#include <lockstep/data/sampler.hpp>
#include <lockstep/parallel/data_parallel.hpp>
#include <lockstep/parallel/policies.hpp>

#include "fixtures.hpp"

// The fixture pieces together make a communicator, so each cf_comm_* lacks only its piece.
static_assert(lockstep::communicator<cf::FullComm>);
static_assert(lockstep::model<cf::GoodModel>);
static_assert(sizeof(lockstep::DataParallel<cf::GoodModel, cf::FullComm>) > 0);
static_assert(sizeof(lockstep::DataParallel<cf::GoodModel, cf::FullComm, lockstep::Accumulate<4>>) > 0);

static_assert(lockstep::Accumulate<4>::steps() == 4);
static_assert(sizeof(lockstep::Accumulate<0>) > 0);  // 0 = dynamic_steps: K at run time
static_assert(sizeof(lockstep::DistributedSampler<lockstep::Sequential, lockstep::DropLast>) > 0);

// The whole user-side path instantiates (member function bodies included).
void train_one_cycle(lockstep::context<lockstep::ThreadComm>& ctx, cf::GoodModel& model) {
  lockstep::DataParallel<cf::GoodModel, lockstep::ThreadComm, lockstep::Accumulate<2>> dp(ctx, model);
  for (int i = 0; i < 2; ++i) {
    auto step = dp.step();
    step.on_gradient_ready()(0);
    if (step.finish()) model.w[0] -= model.gw[0];
  }
}
