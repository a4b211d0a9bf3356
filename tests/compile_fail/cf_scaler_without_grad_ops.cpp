// expect-error: no lockstep::grad_ops for this communicator's memory space.*lockstep/cuda/grad_ops.cuh.*use
// lockstep::NoScaling A loss scaler unscales gradients where they live: a communicator whose memory space has no
// grad_ops specialisation gets a message naming grad_ops, the header and the alternative.
#include <lockstep/parallel/data_parallel.hpp>
#include <lockstep/scaling/scalers.hpp>

#include "fixtures.hpp"

struct DeviceLikeMemory : lockstep::HostMemory {};  // a memory_ops type without grad_ops
struct DeviceLikeComm : cf::RankSize, cf::AllReduce, cf::OtherCollectives {
  DeviceLikeMemory memory() const;
};
static_assert(lockstep::communicator<DeviceLikeComm>);

static_assert(sizeof(lockstep::DataParallel<cf::GoodModel, DeviceLikeComm, lockstep::DynamicScale>) > 0);
