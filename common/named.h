// A whole tensor under the name --check and --dump give it, for what a stage trains beside the
// model's own parameters (stage 10's experts: common/mlp_branch.h, common/moe_model.h).
//
// defines: tpx::NamedArray
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tpx {

template <class T>
struct NamedArray {
  std::string name;                 ///< e.g. "layers.0.experts.3.w_up"
  std::vector<std::int64_t> shape;  ///< e.g. {H, FE}
  std::vector<T> values;            ///< C order
};

}  // namespace tpx
