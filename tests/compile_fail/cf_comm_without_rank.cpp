// expect-error: DataParallel: Comm does not satisfy lockstep::communicator: requirement 1 .*it needs rank
// A communicator must say which rank it is and how many ranks there are.
#include <lockstep/parallel/data_parallel.hpp>

#include "fixtures.hpp"

struct NoRank : cf::AllReduce, cf::OtherCollectives, cf::Memory {};

static_assert(sizeof(lockstep::DataParallel<cf::GoodModel, NoRank>) > 0);
