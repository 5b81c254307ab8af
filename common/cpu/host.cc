#include "host.h"

#include <fstream>
#include <thread>
#include <vector>

#include <fmt/format.h>

namespace tpx::cpu {

std::string host_cpu_name() {
  std::ifstream in("/proc/cpuinfo");
  std::string model = "unknown cpu";
  std::vector<std::string> ident;  // cpu family, model, stepping, in the file's order
  bool named = false;
  for (std::string line; std::getline(in, line);) {
    if (line.find_first_not_of(" \t") == std::string::npos) {
      if (named || !ident.empty()) break;  // the end of the first processor's block
      continue;
    }
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string key = line.substr(0, colon);
    key.erase(key.find_last_not_of(" \t") + 1);
    const auto start = line.find_first_not_of(" \t", colon + 1);
    const std::string value = start == std::string::npos ? "" : line.substr(start);
    if (key == "model name" && !named) {
      model = value;
      named = true;
    } else if (key == "cpu family" || key == "model" || key == "stepping") {
      ident.push_back(fmt::format("{} {}", key, value));
    }
  }
  if (!ident.empty()) model += fmt::format(" ({})", fmt::join(ident, ", "));
  return fmt::format("{}, {} cores", model, std::thread::hardware_concurrency());
}

}  // namespace tpx::cpu
