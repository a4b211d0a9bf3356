// expect-error: DataParallel: Model does not satisfy lockstep::model: requirement 1
// A model must expose its tensors through parameters().
#include <lockstep/comm/thread_comm.hpp>
#include <lockstep/parallel/data_parallel.hpp>

struct NoParameters {
  std::vector<float> w, gw;
  std::vector<float>& weights() { return w; }  // the wrong name
};

static_assert(sizeof(lockstep::DataParallel<NoParameters, lockstep::ThreadComm>) > 0);
