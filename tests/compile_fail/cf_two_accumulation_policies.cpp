// expect-error: DataParallel: give at most one accumulation_policy
// Two accumulation policies contradict each other.
#include <lockstep/parallel/data_parallel.hpp>

#include "fixtures.hpp"

static_assert(
    sizeof(lockstep::DataParallel<cf::GoodModel, cf::FullComm, lockstep::EveryStep, lockstep::Accumulate<4>>) > 0);
