#pragma once
//! Policy tags for DistributedSampler<Order, Tail> (see distributed_sampler.hpp).

namespace lockstep {

//! Order: a fresh pseudo-random permutation of the data set for each (seed, epoch).
struct Shuffle {};
//! Order: 0, 1, ..., len-1 (evaluation, debugging).
struct Sequential {};

//! Tail: when len is not divisible by the number of ranks, repeat indices from the start of
//! the epoch's list until every rank has ceil(len / ranks) samples (PyTorch's default).
struct Pad {};
//! Tail: drop the last len % ranks indices of the epoch's list, so every rank has
//! floor(len / ranks) samples (PyTorch's drop_last=True).
struct DropLast {};

}  // namespace lockstep
