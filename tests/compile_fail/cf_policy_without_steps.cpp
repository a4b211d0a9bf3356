// expect-error: DataParallel: every policy must be an accumulation_policy
// A policy type that is no known policy (here: an accumulation policy without steps()).
#include <lockstep/parallel/data_parallel.hpp>

#include "fixtures.hpp"

struct EveryOtherStep {
  int every = 2;  // forgot steps()
};

static_assert(sizeof(lockstep::DataParallel<cf::GoodModel, cf::FullComm, EveryOtherStep>) > 0);
