// expect-error: Tail must be lockstep::Pad or lockstep::DropLast
// DistributedSampler's second argument is a tail tag (swapped arguments are caught too).
#include <lockstep/data/sampler.hpp>

static_assert(sizeof(lockstep::DistributedSampler<lockstep::Shuffle, lockstep::Shuffle>) > 0);
