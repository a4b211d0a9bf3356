// expect-error: DataParallel: Model does not satisfy lockstep::model: requirement 1
// parameters() must return a range of lockstep::parameter (typed value + gradient views),
// not raw spans of values.
#include <span>
#include <vector>

#include <lockstep/comm/thread_comm.hpp>
#include <lockstep/parallel/data_parallel.hpp>

struct SpansModel {
  std::vector<float> w, gw;
  std::vector<std::span<float>> parameters() { return {std::span(w)}; }
};

static_assert(sizeof(lockstep::DataParallel<SpansModel, lockstep::ThreadComm>) > 0);
