// expect-error: Order must be lockstep::Shuffle or lockstep::Sequential
// DistributedSampler's first argument is an order tag, not e.g. a seed type.
#include <lockstep/data/sampler.hpp>

static_assert(sizeof(lockstep::DistributedSampler<int, lockstep::Pad>) > 0);
