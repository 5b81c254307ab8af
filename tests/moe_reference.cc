// Runs the double-precision MoE MLP (common/moe.h) on one case for tests/moe_torch.py:
//
//     moe_reference IN.json OUT.json
//
// IN holds the shape (tokens, hidden, experts, topk, expert_ffn, shared_ffn, router,
// capacity_factor, aux_loss_weight) and the numbers: x [T, H], target [T, H], bias [E] (or
// empty), w_router, w_gate, w_up, w_down and, with shared experts, shared_gate, shared_up,
// shared_down, each flat in C order. OUT holds the loss ½·mean((y − target)²), the auxiliary loss,
// y, the routing (expert, weight, kept, routed_per_expert, tokens_per_expert, capacity) and the
// gradients of loss + L_aux: x and every weight. Exit status 0, or 2 with one line on stderr for
// a file that cannot be read or does not describe a case.
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/check.h"
#include "common/moe.h"
#include "common/output.h"

namespace {

using nlohmann::json;
using Vec = tpx::HostVector<double>;

tpx::MoeShape shape_of(const json& in) {
  tpx::MoeShape m;
  m.tokens = in.at("tokens").get<std::int64_t>();
  m.hidden = in.at("hidden").get<std::int64_t>();
  m.experts = in.at("experts").get<std::int64_t>();
  m.topk = in.at("topk").get<std::int64_t>();
  m.expert_ffn = in.at("expert_ffn").get<std::int64_t>();
  m.shared_ffn = in.at("shared_ffn").get<std::int64_t>();
  const std::string router = in.at("router").get<std::string>();
  if (router != "softmax" && router != "sigmoid")
    throw tpx::Error("router must be softmax or sigmoid (got '" + router + "')");
  m.router = router == "softmax" ? tpx::MoeRouter::softmax : tpx::MoeRouter::sigmoid;
  m.capacity_factor = in.at("capacity_factor").get<double>();
  m.aux_loss_weight = in.at("aux_loss_weight").get<double>();
  if (m.tokens < 1 || m.hidden < 1 || m.experts < 1 || m.expert_ffn < 1 || m.shared_ffn < 0 ||
      m.topk < 1 || m.topk > m.experts || m.capacity_factor < 0.0)
    throw tpx::Error("the sizes must be positive, 1 <= topk <= experts, capacity_factor >= 0");
  return m;
}

Vec array(const json& in, const char* name, std::size_t size) {
  Vec v = in.at(name).get<Vec>();
  if (v.size() != size)
    throw tpx::Error(std::string(name) + " has " + std::to_string(v.size()) + " numbers, not " +
                     std::to_string(size));
  return v;
}

json run(const json& in) {
  const tpx::MoeShape m = shape_of(in);
  const auto T = static_cast<std::size_t>(m.tokens), H = static_cast<std::size_t>(m.hidden),
             E = static_cast<std::size_t>(m.experts), FE = static_cast<std::size_t>(m.expert_ffn),
             SF = static_cast<std::size_t>(m.shared_ffn);
  const Vec x = array(in, "x", T * H), target = array(in, "target", T * H);
  const Vec bias = in.at("bias").get<Vec>();
  if (!bias.empty() && bias.size() != E) throw tpx::Error("bias must be empty or hold E numbers");
  tpx::MoeWeights<double> w;
  w.router = array(in, "w_router", H * E);
  w.w_gate = array(in, "w_gate", E * H * FE);
  w.w_up = array(in, "w_up", E * H * FE);
  w.w_down = array(in, "w_down", E * FE * H);
  if (SF > 0) {
    w.shared_gate = array(in, "shared_gate", H * SF);
    w.shared_up = array(in, "shared_up", H * SF);
    w.shared_down = array(in, "shared_down", SF * H);
  }
  const tpx::MoeForward<double> f = tpx::moe_forward<double>(m, w, x, bias);
  // The block's loss: ½·mean((y − target)²), dy = (y − target)/n.
  Vec dy(f.y.size());
  double sum = 0.0;
  for (std::size_t i = 0; i < dy.size(); ++i) {
    sum += (f.y[i] - target[i]) * (f.y[i] - target[i]);
    dy[i] = (f.y[i] - target[i]) / double(dy.size());
  }
  const tpx::MoeGrads<double> g = tpx::moe_backward<double>(m, w, x, f, dy);
  json out;
  out["loss"] = 0.5 * sum / double(dy.size());
  out["aux_loss"] = f.aux_loss;
  out["y"] = f.y;
  out["capacity"] = tpx::moe_capacity(m);
  out["expert"] = f.routing.expert;
  out["weight"] = f.routing.weight;
  out["kept"] = f.routing.kept;
  out["routed_per_expert"] = f.routing.routed_per_expert;
  out["tokens_per_expert"] = f.routing.tokens_per_expert;
  json grads;
  grads["x"] = g.x;
  grads["w_router"] = g.w.router;
  grads["w_gate"] = g.w.w_gate;
  grads["w_up"] = g.w.w_up;
  grads["w_down"] = g.w.w_down;
  if (SF > 0) {
    grads["shared_gate"] = g.w.shared_gate;
    grads["shared_up"] = g.w.shared_up;
    grads["shared_down"] = g.w.shared_down;
  }
  out["grads"] = grads;
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: moe_reference IN.json OUT.json\n");
    return 2;
  }
  try {
    std::ifstream file(argv[1]);
    if (!file) throw tpx::Error(std::string("cannot read '") + argv[1] + "'");
    const json out = run(json::parse(file));
    tpx::write_text_file(argv[2], out.dump());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moe_reference: %s: %s\n", argv[1], e.what());
    return 2;
  }
  return 0;
}
