// expect-error: DataParallel: Comm does not satisfy lockstep::communicator: requirements 2-6
// A communicator without all_reduce cannot average gradients.
#include <lockstep/parallel/data_parallel.hpp>

#include "fixtures.hpp"

struct NoAllReduce : cf::RankSize, cf::OtherCollectives, cf::Memory {};

static_assert(sizeof(lockstep::DataParallel<cf::GoodModel, NoAllReduce>) > 0);
