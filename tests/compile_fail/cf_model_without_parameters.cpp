// expect-error: DataParallel: Model does not satisfy lockstep::model: requirement 1
// A model must expose its tensors through parameters().
#include <lockstep/data_parallel.hpp>
#include <lockstep/thread_comm.hpp>

struct NoParameters {
  std::vector<float> w, gw;
  std::vector<float>& weights() { return w; }  // the wrong name
};

static_assert(sizeof(lockstep::DataParallel<NoParameters, lockstep::ThreadComm>) > 0);
