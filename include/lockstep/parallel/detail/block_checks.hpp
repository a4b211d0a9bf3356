#pragma once
//! The misuse block_units refuses, named alike on every rank (every rank runs the same
//! protocol): a FullySharded configuration the model or memory cannot serve, a block used out
//! of turn, a gradient outside its block's backward use. Each throws config_error saying what
//! to do instead.

#include <cstddef>
#include <string>
#include <vector>

#include "lockstep/core/dtype.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/parallel/detail/binding.hpp"
#include "lockstep/parallel/policies.hpp"

namespace lockstep::detail {

//! FullySharded::param_dtype: f32 or bf16, a model that takes typed values (model (i)) and a
//! memory space that converts (has_convert), and BlockBuffers in range; model (i) at all.
inline void check_block_config(const model_hooks& model, const BlockBuffers& buffers, dtype param_dtype,
                               bool has_convert) {
  if (param_dtype != dtype::f32 && param_dtype != dtype::bf16)
    throw config_error(std::string("FullySharded::param_dtype is ") + name_of(param_dtype) +
                       ": give dtype::f32 (values lent as they are) or dtype::bf16 (fp32 shards, bf16 lent)");
  if (param_dtype != dtype::f32 && !model.typed_attach)
    throw config_error("FullySharded::param_dtype = bf16: the model must take its values in another element type "
                       "than its own: give it attach(i, value, grad, lockstep::dtype) (lockstep::model (i))");
  if (param_dtype != dtype::f32 && !has_convert)
    throw config_error("FullySharded::param_dtype = bf16: the communicator's memory space has no "
                       "convert(dst, dst_t, src, src_t, count) (memory_ops_with_convert)");
  if (!model.attach)
    throw config_error("ShardedGradients / FullySharded: the model must lend its storage to lockstep: give it "
                       "attach(i, value, grad) (lockstep::model (i))");
  if (buffers.prefetch < 0 || buffers.scatters_in_flight < 1)
    throw config_error("BlockBuffers: prefetch must be >= 0 and scatters_in_flight >= 1");
}

//! A use of block k for pass p may begin (blocks: block_layout's, open: a micro-step is open).
template <class Block>
void check_block_use(const std::vector<Block>& blocks, std::size_t k, pass p, bool open) {
  if (k >= blocks.size())
    throw config_error("use_block(" + std::to_string(k) + "): the model has " + std::to_string(blocks.size()) +
                       " blocks (model.blocks())");
  const Block& b = blocks[k];
  const std::string name = "block " + std::to_string(k);
  if (b.in_use) throw config_error(name + " is requested while still in use: end its use (the block_use) first");
  if (p == pass::forward && open && b.forward)
    throw config_error(name + " is requested twice in one forward: use each block once per forward (and once in "
                              "backward, which also covers its recomputation)");
  if (p == pass::backward) {
    if (!open) throw config_error(name + " is used in backward outside a step: call dp.step() first");
    if (!b.forward)
      throw config_error(name + " is used in backward but was never used in this step's forward: request it with " +
                         "dp.use_block(" + std::to_string(k) + ", lockstep::pass::forward) in the forward");
    if (b.backward) throw config_error(name + " is used twice in one backward");
  }
}

//! Block k is still in use when the next micro-step begins.
inline config_error block_unfinished(std::size_t k) {
  return config_error("block " + std::to_string(k) +
                      " is still in use at the next step: end every block_use before step()");
}

//! DataParallel::wait_parameters under block sharding.
inline config_error wait_parameters_refused() {
  return config_error("with ShardedGradients / FullySharded, a block's values are there during its use: call "
                      "dp.use_block(k, pass) instead of wait_parameters");
}

//! Parameter i ('name', of block k) got its gradient: the block must be in its backward use.
template <class Block>
void check_gradient_in_use(const Block& b, std::size_t i, const std::string& name, std::size_t k) {
  if (!b.in_use || !b.backward)  // (a unit of another element type may have launched already)
    throw config_error("parameter " + std::to_string(i) + " ('" + name + "') got a gradient outside the backward use " +
                       "of its block " + std::to_string(k) + ": call dp.use_block(" + std::to_string(k) +
                       ", lockstep::pass::backward) before its backward");
}

}  // namespace lockstep::detail
