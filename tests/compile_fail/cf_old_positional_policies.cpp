// expect-error: in a policy.s place is the old positional form
// Earlier versions took the policies by position, braces for defaults; the message names the
// form that replaced it.
#include <lockstep/parallel/data_parallel.hpp>
#include <lockstep/scaling/scalers.hpp>

#include "fixtures.hpp"

void old_form(lockstep::context<cf::FullComm>& ctx, cf::GoodModel& m) {
  lockstep::DataParallel<cf::GoodModel, cf::FullComm, lockstep::EveryStep, lockstep::DynamicScale> dp(
      ctx, m, {}, {}, lockstep::DynamicScale());
}
