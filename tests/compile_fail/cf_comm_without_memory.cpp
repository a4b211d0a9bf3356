// expect-error: DataParallel: Comm does not satisfy lockstep::communicator: requirement 7
// A communicator must say how its memory space is touched (memory() → memory_ops).
#include <lockstep/parallel/data_parallel.hpp>

#include "fixtures.hpp"

struct NoMemory : cf::RankSize, cf::AllReduce, cf::OtherCollectives {};

static_assert(sizeof(lockstep::DataParallel<cf::GoodModel, NoMemory>) > 0);
